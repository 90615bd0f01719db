"""Microseconds per call of calls captured back to back in one CUDA graph and replayed: what a kernel costs inside a
step's graph, where replays, not Python, launch it."""
import torch


def us_per_call(calls: list, replays: int = 20) -> float:
    """Each call runs once outside the capture first (compiles, warm-up), on a side stream as capture wants."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(calls))
