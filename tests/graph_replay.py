"""A GPU op under torch.compile, captured as one CUDA graph, as the rollout's decode step runs it."""
import torch


def assert_replays_exactly(fn, x: torch.Tensor, want: torch.Tensor, replays: int = 3) -> None:
    """fn compiled with static shapes (dynamic=False, as decode._compiled does), warmed up on a side stream, then
    captured in one CUDA graph over a static copy of x: every replay gives `want` bit for bit."""
    step = torch.compile(fn, dynamic=False)
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(static_x)
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
