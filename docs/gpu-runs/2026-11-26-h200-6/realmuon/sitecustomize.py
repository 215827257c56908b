# The A/B baseline of .gpurun/run7.sh: DeepSpeed's real Muon modules loaded at start, so that
# grpo.training.deepspeed_engine.skip_deepspeed_muon leaves them alone (what every run did before it).
try:
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    print("[realmuon] loaded")
except Exception as e:  # reported, the run goes on
    print(f"[realmuon] not loaded: {e!r}")
