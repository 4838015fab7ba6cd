"""A CudaGraphRunner whose 'capture' keeps the captured computation and whose 'replay' re-runs it into the same
static output tensors: everything around the graph (bucket choice, padded static inputs, static features, the
backend's static metadata, the runner reading the outputs back) is the production code."""

from __future__ import annotations

from runtime.cuda_graph import CudaGraphRunner, GraphOutputs
from runtime.model_runner import ModelRunner


class _FakeGraph:
    def __init__(self, run, outputs: GraphOutputs) -> None:
        self.run, self.outputs, self.replays = run, outputs, 0

    def replay(self) -> None:
        new = self.run()
        for name in ("hidden", "logits", "argmax", "features"):
            static = getattr(self.outputs, name)
            if static is not None:
                static.copy_(getattr(new, name))
        for static, fresh in zip(self.outputs.tree or (), new.tree or ()):
            static.copy_(fresh)
        self.replays += 1


class FakeGraphRunner(CudaGraphRunner):
    def _capture_graph(self, run):
        outputs = run()
        return _FakeGraph(run, outputs), outputs

    def num_replays(self) -> int:
        return sum(graph.replays for graph, _ in self.graphs.values())


def install_fake_graphs(runner: ModelRunner, capture_layers: list[int] | None = None,
                        sizes: list[int] | None = None) -> FakeGraphRunner:
    """Give a (CPU, triton-backend) runner fake-captured graphs shaped by its EngineConfig's cuda_graph_* fields, as
    ModelRunner does with real ones on CUDA. sizes: other buckets (<= the max batch) than capture_batch_sizes picks,
    so that small CPU batches get padded."""
    ec = runner.engine_config
    gr = runner.graph_runner = FakeGraphRunner(runner, ec.cuda_graph_max_bs, ec.cuda_graph_num_draft_tokens,
                                               ec.cuda_graph_max_bs_decode, ec.cuda_graph_mask_width, capture_layers,
                                               ec.torch_compile_max_bs if ec.enable_torch_compile else 0)
    if sizes is not None:
        gr.sizes = {q: [s for s in sizes if s <= gr.sizes[q][-1]] for q in gr.query_lens}
    gr.capture()
    runner.use_cuda_graph = True
    return gr
