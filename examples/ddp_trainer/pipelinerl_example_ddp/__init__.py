"""An example third-party trainer adapter: torch DDP on pipelinerl-sdk's trainer kit."""
