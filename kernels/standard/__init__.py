"""The standard decode path: vLLM's default Hopper kernel decomposition for Kimi K3."""
