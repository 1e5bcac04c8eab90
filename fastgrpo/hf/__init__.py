"""The only code that touches transformers / PEFT / bitsandbytes internals: the per-architecture table, model
lookups, PEFT state, instance-level forward binding, version guards."""
