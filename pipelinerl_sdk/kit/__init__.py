"""Adapter kits: what every engine or trainer adapter would otherwise repeat (submodules import torch)."""
