"""Scaffolding for adapters' own tests, installed with the SDK, so that an adapter's tests run from
the adapter's directory (as a third party's would) without reaching into the SDK's ``tests/``.

- :mod:`~.ranks`: a trainer backend's steps on spawned ranks (or torchrun), and the same steps in
  plain torch to compare with;
- :mod:`~.fixtures`: pytest fixtures (a tiny model built offline): import them into a conftest.

Test-only: the submodules import torch and pytest; ``import pipelinerl_sdk`` never imports them.
"""
