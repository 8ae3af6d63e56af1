"""The step loop: `Engine` (offline and stepped), overlap of host and device work, one step's
sampler rows and prompt logprobs, stop conditions, stats, and `EngineClient`, what its hosts
(`worker/hosts/`) offer a replica. The parts it steps are built by `worker/assembly/`."""
