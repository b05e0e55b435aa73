"""Other RL frameworks' protocols, served by every backend (:mod:`.pipelinerl_trainer`)."""
