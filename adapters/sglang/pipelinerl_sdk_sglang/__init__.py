"""pipelinerl-sdk adapter for SGLang 0.5.23 (see README.md)."""
