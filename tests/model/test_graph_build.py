"""Step graphs compiled in a process of their own (``engine/graph_build.py``): the serving process
runs them through their entry points without ever importing torch's compiler, gives the tokens of
the graphs compiled in it, and refuses graphs that do not fit its model."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import engine.graph_build as graph_build
import engine.step_graphs as step_graphs
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 9, 17, 33, 2, 8, 100], [41, 7, 7, 300, 12], [3, 4]]
MAX_TOKENS = 8

# A fresh process (nothing of the compiler imported before it starts) that serves the tiny model
# with int4 weights through graphs built elsewhere: its tokens, the manifest, and which of the
# compiler's modules it imported.
SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    torch.set_num_threads(1)
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from scheduler.sampling_params import SamplingParams

    model_dir, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=128,
                                    block_size=8, compile=True, quantization="int4"))
    assert engine.wait_until_compiled(timeout=900)
    graphs = engine.runner.graphs
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    tokens = [[] for _ in prompts]
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[int(delta.request_id)].extend(delta.new_token_ids)
    compiler = [m for m in ("torch._dynamo", "torch._inductor", "sympy") if m in sys.modules]
    print(json.dumps({"loaded": graphs.loaded, "mode": graphs.mode, "tokens": tokens,
                      "compiler": compiler,
                      "manifest": graphs.manifest(engine.runner._dummy_step)}))
    """
)


def _engine(model_dir: Path, compile: bool) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            num_kv_blocks=128,
            block_size=8,
            compile=compile,
            quantization="int4",
        )
    )
    assert engine.wait_until_compiled(timeout=900)
    return engine


def _generate(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"p{index}-{id(params)}", prompt, params)
    tokens: list[list[int]] = [[] for _ in PROMPTS]
    while engine.has_unfinished_requests():
        for delta in engine.step():
            assert delta.error is None, delta.error
            tokens[int(delta.request_id[1:].split("-")[0])].extend(delta.new_token_ids)
    return tokens


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path) -> dict:
    """What the fresh serving process reported."""
    from kernels.cpu_ops import has_fixed_order_attention

    if not has_fixed_order_attention():
        pytest.skip("the C++ operators are not built here")
    result = subprocess.run(  # noqa: S603 (our own interpreter and script)
        [sys.executable, "-c", SCRIPT, str(tiny_llama_dir), json.dumps(PROMPTS), str(MAX_TOKENS)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _loaded_graphs(engine: LLMEngine, manifest: dict) -> step_graphs.StepGraphs:
    """A ``StepGraphs`` of ``engine``'s model that loads ``manifest`` (raises where it fails)."""
    runner = engine.runner
    graphs = step_graphs.StepGraphs(
        runner.model,
        compile=False,
        operator_step=runner.backend.operator_step,
        one_token_steps=runner.one_token_steps,
    )
    graphs._load_built(manifest, runner._dummy_step)
    return graphs


def test_graphs_built_elsewhere_serve_without_the_compiler(served, tiny_llama_dir) -> None:
    """The serving process imported none of the compiler, ran its steps through the graphs
    built in the other process, and gave the tokens of an engine that compiled the same graphs
    itself."""
    assert served["loaded"] and served["mode"] == step_graphs.COMPILED
    assert served["compiler"] == []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step_graphs.StepGraphs, "build_elsewhere", False)
        compiled_here = _engine(tiny_llama_dir, compile=True)
    assert not compiled_here.runner.graphs.loaded
    assert _generate(compiled_here) == served["tokens"]


def test_a_third_process_loads_the_graphs_and_refuses_ones_that_do_not_fit(
    served, tiny_llama_dir
) -> None:
    """The manifest loads in any process holding the same model (here an eager engine's, whose
    steps then run through the graphs with the same tokens); a graph whose arguments are laid
    out otherwise, or bound to other weights of the same layout, is refused."""
    manifest = served["manifest"]
    engine = _engine(tiny_llama_dir, compile=False)
    graphs = _loaded_graphs(engine, manifest)
    graphs.loaded, graphs.mode = True, step_graphs.COMPILED
    engine.runner.graphs = graphs
    assert _generate(engine) == served["tokens"]

    def altered(change) -> dict:
        copy = json.loads(json.dumps(manifest))
        change(next(graph for graph in copy["graphs"] if graph["kind"] == "stack"))
        return copy

    def other_layout(graph: dict) -> None:
        index = next(i for i, fixed in enumerate(graph["fixed"]) if fixed is not None)
        graph["fixed"][index][1][0] += 1

    def other_weights(graph: dict) -> None:
        # two layers' output projections: the same layout, other numbers
        sources = graph["sources"]
        layer = "_modules['layers']._modules['{}']._modules['self_attn']._modules['o_proj']"
        first = next(i for i, s in enumerate(sources) if s and layer.format(0) in s)
        second = sources.index(sources[first].replace(layer.format(0), layer.format(1)))
        sources[first], sources[second] = sources[second], sources[first]

    with pytest.raises(RuntimeError, match="laid out otherwise"):
        _loaded_graphs(engine, altered(other_layout))
    with pytest.raises(RuntimeError, match="output it gave where it was built"):
        _loaded_graphs(engine, altered(other_weights))


def test_graphs_kept_from_an_earlier_start_load_at_once(
    served, tiny_llama_dir, tmp_path, monkeypatch, caplog
) -> None:
    """A later engine of the same model and settings loads the kept graphs without starting
    another process, with the same tokens; kept graphs that no longer fit (their library gone)
    are built again, and the new manifest kept in their place."""
    monkeypatch.setenv("SPLITFUSE_CACHE", str(tmp_path))
    builds = []
    build = graph_build.GraphBuild.build

    def counted(self) -> dict:
        builds.append(self.path)
        return build(self)

    monkeypatch.setattr(graph_build.GraphBuild, "build", counted)
    first = _engine(tiny_llama_dir, compile=True)
    assert first.runner.graphs.loaded and len(builds) == 1 and builds[0].exists()
    second = _engine(tiny_llama_dir, compile=True)
    assert second.runner.graphs.loaded and len(builds) == 1
    assert _generate(second) == served["tokens"]

    kept = json.loads(builds[0].read_text())
    kept["graphs"][0]["library"] = str(tmp_path / "gone.so")
    builds[0].write_text(json.dumps(kept))
    with caplog.at_level(logging.INFO, logger="engine.step_graphs"):
        third = _engine(tiny_llama_dir, compile=True)
    assert "kept from an earlier start do not fit" in caplog.text
    assert third.runner.graphs.loaded and len(builds) == 2
    assert json.loads(builds[0].read_text())["graphs"][0]["library"] != kept["graphs"][0]["library"]


def test_a_failed_build_compiles_in_this_process(tiny_llama_dir, monkeypatch, caplog) -> None:
    """If the other process fails, the graphs compile here, and serve."""

    def failing(self) -> dict:
        raise RuntimeError("building the step graphs failed (exit code 1)")

    monkeypatch.setattr(graph_build.GraphBuild, "cached", lambda self: None)
    monkeypatch.setattr(graph_build.GraphBuild, "build", failing)
    with caplog.at_level(logging.ERROR, logger="engine.step_graphs"):
        engine = _engine(tiny_llama_dir, compile=True)
    graphs = engine.runner.graphs
    assert "could not be built in a process of their own" in caplog.text
    assert graphs.mode == step_graphs.COMPILED and not graphs.loaded
    assert graphs.stack_direct is not None
    assert all(len(tokens) == MAX_TOKENS for tokens in _generate(engine))


def test_no_graph_of_one_token_where_the_decode_stack_takes_every_one(
    served, tiny_llama_dir, monkeypatch
) -> None:
    """With the decode stack (4-bit weights here) no step of one token reaches the graphs (a
    prompt of one token, a prompt's last chunk of one, decoding alone), so neither the build
    nor the loading process makes that graph; without the stack (float32 weights) such steps
    reach them. Where prompt tokens multiply on AMX tiles a prompt's token bypasses the stack,
    so both graphs are made there."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step_graphs.StepGraphs, "build_elsewhere", False)
        engine = _engine(tiny_llama_dir, compile=True)
    runner = engine.runner
    assert runner.decode_stack is not None
    kinds = [graph["kind"] for graph in served["manifest"]["graphs"]]
    if runner.prompt_tiles:
        assert runner.one_token_steps and kinds == ["single", "stack"]
        assert runner.graphs.direct is not None
        return
    assert not runner.one_token_steps and kinds == ["stack"]
    assert runner.graphs._single is None and runner.graphs.direct is None
    assert runner.graphs.stack_direct is not None
    sizes: list[int] = []
    call = step_graphs.StepGraphs.__call__

    def counted(self, input_ids, *args):
        sizes.append(input_ids.shape[0])
        return call(self, input_ids, *args)

    monkeypatch.setattr(step_graphs.StepGraphs, "__call__", counted)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [[7], list(range(3, 3 + engine.config.max_batch_tokens + 1)), [5, 6]]
    for index, prompt in enumerate(prompts):
        engine.add_request(f"one-{index}", prompt, params)
        while engine.has_unfinished_requests():
            for delta in engine.step():
                assert delta.error is None, delta.error
    assert sizes and 1 not in sizes
    full = LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=128,
                     block_size=8, quantization="none")
    )  # fmt: skip
    assert full.runner.decode_stack is None and full.runner.one_token_steps
