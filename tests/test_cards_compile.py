"""kernels.cards under torch.compile: the compiled decode step traces the decode attention's launcher, which reads the
card's shared memory (max_shared) to pick its tiles since 56bad83. Traced, the driver's query (a C call) breaks the
step's graph at every attention call: the likely reason test_warmup.test_gpu_no_recompile_and_one_capture_per_call
counted 15 graphs where it wants 1 (46-f; not yet rerun on a GPU). max_shared is a constant to the compiler now. The stand-in query below breaks the graph if
traced, so fullgraph=True fails unless the compiler takes max_shared's value as it is."""
import torch

from fastgrpo.kernels import cards


def test_max_shared_is_a_constant_to_torch_compile(monkeypatch):
    def driver_query(index):
        torch._dynamo.graph_break()  # untraceable, as the driver's C query is
        return 232448
    monkeypatch.setattr(cards, "_max_shared", driver_query)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x + cards.max_shared(torch.device("cuda", 0)), fullgraph=True, backend="eager")
    assert compiled(torch.zeros(2)).tolist() == [232448.0, 232448.0]
    torch._dynamo.reset()
