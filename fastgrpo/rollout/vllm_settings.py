"""How a vLLM engine's refusal names the setting to change, for each kind of user: VLLMEngine's keyword in their own
loop, GRPOConfig's field, the `fastgrpo train` flag. The engine cannot tell which of them built it."""

MERGE_SYNC = "lora_sync='merge' (GRPOConfig(vllm_lora_sync='merge'), --vllm-lora-sync merge)"
BUILTIN_ENGINE = ("the built-in engine (GRPOConfig(rollout_engine='builtin'), --rollout-engine builtin, or "
                  "fastgrpo.rollout.BuiltinEngine in place of VLLMEngine)")
