"""How the runner executes a step's forward: eager, or compiled graphs on CPUs.

The model has one forward (``engine/models/llama.py``); this is the one wrapper around it. On a CPU
with the torch attention backend and one process, the decoder stack (``LlamaModel``) is compiled by
``torch.compile`` with dynamic shapes: one graph serves every token count from 2 up (prompt chunks,
many requests decoding, mixes) and one more, specialized, serves a step of exactly one token (a
single request decoding). Inductor fuses each layer's norms, residual adds, rotary and SwiGLU into
a few C++ loops; the matrix products stay ATen's (MKL in float32) or ours (oneDNN with packed
bfloat16 weights, ``engine/packed_linear.py``), and attention is the opaque ``splitfuse::attend``,
so a graph holds no copy of the weights or of the KV cache. The LM head runs outside the graph on
the sampling rows alone.

The graph of one token (a request decoding alone, the step whose Python costs most against its
arithmetic) is a second ``torch.compile`` of the same forward, which takes the step's plan as
tensors (``backend.operator_step``: the KV cache, slots, tables, lengths) instead of the opaque
object: its layers call ``splitfuse_cpu::store_and_attend_step`` and ``blocked_linear`` (or the
quantized product) themselves, so inductor's C++ wrapper runs the whole graph, with no Python
between its kernels (one-stream decode step ~12.3 -> ~11.2 ms on the default model, same
process, 2 cores). A product that needs an opaque packed weight (float32, or bfloat16 that
``blocked_linear`` cannot read) keeps the Python wrapper (``python_wrapper_needed``); a graph of
one token that fails to compile leaves one-token steps to the other graph's form. Once compiled,
it is called directly (``DirectGraph``: without the compiler's guards and the bytecode that
gathers every weight each step, ~0.5 ms of a one-stream step), the compiler's path taken only by
a step whose inputs it does not fit; under the C++ wrapper, through its C++ entry point, which
holds the weights (``splitfuse_cpu.GraphCall``, ``kernels/cpu/graph_call.cpp``): a step hands
over its ~10 own arguments instead of ~440 (int4 weights) made into handles by Python (~0.15 ms
of a one-stream int4 step of ~6.3 ms, alternated step by step in one process). Where the
runner's decode stack takes every step of one token (``one_token_steps`` False: 4-bit or blocked
bfloat16 weights, no AMX prompt tiles), this graph is not made at all: the default model in int4,
2 cores of an AVX2 CPU, cold caches, the two graphs took 139 and 110 s.

The graph of two tokens and up takes the plan as tensors too: its layers call
``splitfuse_cpu::store_and_attend_step``, which attends decode tokens and prompt chunks alike
from the step's tables. With quantized weights (whose products run one operator for every row
count) it too runs under the C++ wrapper and is called through its entry point: no step has
Python between its kernels, and no graph holds a Python object. Where a product switches to
oneDNN's packed weight above a row count (``tensor_plan_unsupported``), it keeps a Python
wrapper, as the graph of one token does there; should it fail to compile, it takes the plan
object (each layer's attention then the Python operator ``splitfuse::attend``).
Such graphs need no compiler to run, so a runner given a ``builder`` has them compiled in a
process of its own (``engine/graph_build.py``; kept for later starts) and only loads them: the
serving process never imports torch's compiler (default model, int4, served with a 64 MiB KV
cache: 486 MiB resident with its graphs against 685 MiB when they compiled in it, 2026-11-27).

    start()  -> mode "compiling": a thread compiles the graphs on dummy steps (over a scratch
                KV cache of two blocks), while every step runs the eager forward
             -> mode "compiled": steps go through the graphs, under the ``eager_on_recompile``
                stance (a step no graph fits runs eagerly instead of stalling on a compile)
             or mode "eager" for good, if compiling failed (logged)

Deterministic mode compiles the graph of two tokens and up alone: its loops sum a row in the same
order whatever the step's size (checked with ``torch.equal`` on the default model), while the
one-token graph's differ from them; a one-token step runs padded to two
(``engine/input_builder.py``), and the graphs compile before any request runs, so that every step
runs the same code.

So the engine serves from the moment the weights are loaded; compiling (about a minute for the
default model on 2 cores, less when inductor's caches in ``<splitfuse cache>/compile`` are warm)
only makes steps faster once it is done. ``wait()`` blocks until it is (offline runs, benchmarks).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import inspect
import logging
import os
import threading
import time
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.device import cpu_code_tag, release_free_memory
from engine.model_resolver import cache_dir

if TYPE_CHECKING:
    from engine.graph_build import GraphBuild

logger = logging.getLogger(__name__)

EAGER, COMPILING, COMPILED = "eager", "compiling", "compiled"

# the thread that compiles (``compiling_in_background`` looks for it)
COMPILE_THREAD_NAME = "splitfuse-compile"

# token counts of the warm-up steps: the dynamic graph (traced at 2, sizes >= 2), then the
# one-token graph (a size-1 dimension is always specialized)
WARM_UP_TOKENS = (2, 1)


def compile_unsupported(device: torch.device, attention_backend: str, world_size: int) -> str:
    """Why compiled steps cannot run here ('' when they can)."""
    if device.type != "cpu":
        return "compiled steps are built for CPUs"
    if attention_backend != "torch":
        return "compiled steps need the torch attention backend"
    if world_size > 1:
        return "tensor-parallel ranks run the eager forward"
    return ""


def deterministic_compile_unsupported(stack: nn.Module) -> str:
    """Why deterministic mode cannot compile this decoder stack ('' when it can). Its graph of
    two tokens and up reduces a row in the same order whatever the step's size when every product
    in it is one whose rows never depend on the others (oneDNN with a packed weight, or the
    quantized product: ``engine/deterministic_rows.py``); a product run as fixed tiles is a loop
    whose length follows the step, which a graph cannot hold."""
    from engine.layers import MatmulLayer

    for name, module in stack.named_modules():
        unpacked = isinstance(module, MatmulLayer) and module.packed_weight is None
        if unpacked and not module.quant_bits:
            return f"deterministic mode runs eagerly: {name} has no packed weight"
    return ""


def python_wrapper_needed(stack: nn.Module) -> str:
    """Why the graph of one token cannot run under inductor's C++ wrapper ('' when it can): that
    wrapper passes tensors and numbers to operators, not the opaque objects that hold weights
    packed for oneDNN (float32, or bfloat16 that ``blocked_linear`` cannot read)."""
    from engine.layers import MatmulLayer
    from engine.moe import StackedExperts

    for name, module in stack.named_modules():
        if isinstance(module, MatmulLayer):
            if module.packed_weight is not None and module.blocked_weight is None:
                return f"{name} multiplies with a weight packed for oneDNN"
        elif isinstance(module, StackedExperts) and module.packed is not None:
            return f"{name} multiplies with experts packed for oneDNN"
    return ""


def tensor_plan_unsupported(stack: nn.Module) -> str:
    """Why the graph of two tokens and up cannot run under inductor's C++ wrapper ('' when it
    can; it then keeps a Python wrapper): one graph serves every token count there, so a
    product must run the same operator whatever the rows, and one that the wrapper can call.
    The quantized products do; an unquantized one switches from ``blocked_linear`` to oneDNN's
    packed weight (an opaque object) above a row count."""
    from engine.layers import MatmulLayer

    why = python_wrapper_needed(stack)
    if why:
        return why
    for name, module in stack.named_modules():
        if isinstance(module, MatmulLayer) and module.packed_weight is not None:
            return f"{name} multiplies many rows with a weight packed for oneDNN"
    return ""


def _set_cache_dir() -> None:
    """Points inductor's on-disk caches at the splitfuse cache, one folder per CPU kind
    (``cpu_code_tag``: inductor's caches do not tell one CPU's code from another's), unless the
    user chose a place (importing torch._dynamo already sets the variable to inductor's
    default: that one is not a choice)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "compile" / cpu_code_tag())


def resident_mib() -> float:
    """This process's resident memory (MiB); 0 where /proc is not there."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
    except OSError:
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _own_forward(stack: nn.Module) -> Callable[..., torch.Tensor]:
    """``stack.forward`` bound to a copy of its code object. The compiler keeps its graphs, and
    counts them against its recompile limit, per code object: with the class's own, every model
    built in one process (tests, a benchmark's two engines) would share one cache and one limit.
    The module itself stays eager and shares its weights with the graphs."""
    function = type(stack).forward
    fresh = types.FunctionType(
        function.__code__.replace(),  # an equal but distinct code object
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    return types.MethodType(fresh, stack)


def _compile_options() -> dict[str, Any]:
    """The options of a graph (a new dict each time: ``torch.compile`` takes some out of it)."""
    # the code object is this model's alone, and its modules never change after loading:
    # guarding every parameter costs ~0.6 ms a step for nothing
    return {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}


class _GraphRecorder:
    """A ``torch.compile`` backend: inductor (``compile_fx`` with ``config_patches``, what the
    ``inductor`` backend runs), keeping each graph it compiles with the source of each of its
    arguments, so that ``DirectGraph`` can call the graph itself."""

    def __init__(self, config_patches: dict[str, Any]) -> None:
        self.config_patches = config_patches
        self.graphs: list[tuple[list[str | None], Callable[..., Any]]] = []

    @property
    def python_wrapper(self) -> bool:
        """Whether its graphs run under inductor's Python wrapper (not the C++ one)."""
        return not self.config_patches.get("cpp_wrapper", False)

    def __call__(self, graph_module: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        sources: list[str | None] = []
        for node in graph_module.graph.find_nodes(op="placeholder"):
            argument = node.meta.get("grapharg")
            sources.append(None if argument is None else argument.source.name)
        compiled = compile_fx(
            graph_module, example_inputs, config_patches=dict(self.config_patches)
        )
        self.graphs.append((sources, compiled))
        return compiled


# ``void inductor_entry_impl(AtenTensorHandle* inputs, AtenTensorHandle* outputs)``, the function
# of a graph's shared library that inductor's Python binding of its C++ wrapper calls
_ENTRY_SYMBOL = "_Z19inductor_entry_implPP16AtenTensorOpaqueS1_"


def _inductor_graph(compiled: Callable[..., Any]) -> Any:
    """The graph inductor made (``CompiledFxGraph``) inside the callable ``compile_fx`` returns
    (the AOT dispatcher's wrappers around it), or None."""
    from torch._inductor.output_code import CompiledFxGraph

    found, pending, seen = [], [compiled], set()
    while pending and len(seen) < 100:
        item = pending.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, CompiledFxGraph):
            found.append(item)
            continue
        for name in ("compiled_fn", "__wrapped__"):
            if getattr(item, name, None) is not None:
                pending.append(getattr(item, name))
        for cell in getattr(item, "__closure__", None) or ():
            with contextlib.suppress(ValueError):  # an empty cell has no contents
                pending.append(cell.cell_contents)
    return found[0] if len(found) == 1 else None


class DirectGraph:
    """The compiled graph of one token called without the compiler's frame evaluation: its
    guards, the bytecode that gathers its ~200 (bfloat16) to ~440 (int4) arguments (every
    weight) from the module tree each step, the stance's context manager (~0.5 ms of a
    one-stream decode step of ~10-12 ms on the default model, 2 cores, bfloat16 and int4
    alike). The arguments rooted in the module (weights, buffers) are gathered once; each call
    reads the step's own (token ids, positions, the plan's tensors, their dynamic sizes) through
    the sources the compiler recorded.

    What the compiler's guards check of those, this checks too, or the call returns None and the
    step takes the compiler's path: each tensor's dtype, device, rank and contiguity as traced,
    its sizes equal to the trace's where the graph took them as constants, and every dynamic size
    at least 2 (the compiler specializes sizes 0 and 1). The module's own state is not checked,
    as the compiler is told not to (``skip_guard_on_all_nn_modules_unsafe``).
    """

    def __init__(
        self,
        compiled: Callable[..., Any],
        sources: list[str | None],
        stack: nn.Module,
        example: dict[str, Any],
    ) -> None:
        """``sources``: each argument's, as the compiler names them (``L['plan'].lens``);
        ``example``: the traced call's arguments by the forward's names (``self`` apart).
        Raises ValueError where an argument is not one this class can read. ``compiled`` is
        None for a graph compiled in another process (``bind_entry`` then gives the call)."""
        self.compiled = compiled
        self.sources = sources
        self.arguments: list[Any] = []  # the module's arguments; the step's filled in per call
        # (index of the argument, its reader) of each of the step's arguments
        self.readers: list[tuple[int, Callable[[dict[str, Any]], Any]]] = []
        # positions in ``readers`` of the step's tensors, and (dtype, device, rank, ((dim, size)
        # of each constant size)) of each as traced
        self.tensor_positions: list[int] = []
        self.tensor_checks: list[tuple[torch.dtype, torch.device, int, tuple]] = []
        self.size_positions: list[int] = []  # positions in ``readers`` of its dynamic sizes
        for index, source in enumerate(sources):
            if source is None or not source.startswith("L['"):
                raise ValueError(f"argument {index} of the graph comes from {source}")
            name = source[3 : source.index("'", 3)]
            # a source's name is a Python expression over the frame's locals ``L``, as the
            # compiler's own guards read it
            reader = eval(f"lambda L: {source}", {"__builtins__": {}})  # noqa: S307
            if name == "self":
                self.arguments.append(reader({"self": stack}))
                continue
            if name not in example:
                raise ValueError(f"argument {index} of the graph comes from {source}")
            value = reader(example)
            self.arguments.append(None)
            if isinstance(value, torch.Tensor):
                if not value.is_contiguous():
                    raise ValueError(f"{source} is not contiguous")
                constant = tuple(
                    (dim, size)
                    for dim, size in enumerate(value.shape)
                    if f"{source}.size()[{dim}]" not in sources
                )
                self.tensor_positions.append(len(self.readers))
                self.tensor_checks.append((value.dtype, value.device, value.dim(), constant))
            elif type(value) is int:
                self.size_positions.append(len(self.readers))
            else:
                raise ValueError(f"{source} is a {type(value).__name__}")
            self.readers.append((index, reader))
        # the graph's C++ entry point holding the module's arguments (``use_entry_point``),
        # and the shared library it is in
        self.entry: Any = None
        self.library: str | None = None

    def __call__(self, **step: Any) -> torch.Tensor | None:
        """The graph's output for this step's arguments (by the forward's names), or None
        where the graph does not fit them."""
        values = [reader(step) for _, reader in self.readers]
        tensors = [values[position] for position in self.tensor_positions]
        for tensor, (dtype, device, rank, constant) in zip(
            tensors, self.tensor_checks, strict=True
        ):
            if (
                tensor.dtype != dtype
                or tensor.device != device
                or tensor.dim() != rank
                or not tensor.is_contiguous()
                or any(tensor.shape[dim] != size for dim, size in constant)
            ):
                return None
        sizes = [values[position] for position in self.size_positions]
        if any(size < 2 for size in sizes):
            return None
        if self.entry is not None:
            (output,) = self.entry.run(tensors, sizes)
            return output
        if self.compiled is None:
            return None
        (output,) = self.compiled(*self._arguments(values))
        return output

    def _arguments(self, values: list[Any]) -> list[Any]:
        """Every argument of the graph, the step's ``values`` (in ``readers``' order) in place."""
        arguments = list(self.arguments)
        for (index, _), value in zip(self.readers, values, strict=True):
            arguments[index] = value
        return arguments

    def use_entry_point(self, example: dict[str, Any]) -> str:
        """Calls the graph through its C++ entry point from now on, where it has one: inductor
        compiled it with its C++ wrapper, and the compiled call hands that wrapper the very
        arguments it was given and returns its one output as it is (checked on ``example``).
        Returns why not ("" where it does)."""
        graph = _inductor_graph(self.compiled)
        if graph is None:
            return "no inductor graph found in the compiled function"
        wrapper = graph.current_callable
        module = getattr(wrapper, "__globals__", {})
        entry = module.get("inductor_entry")
        if module.get("call") is not wrapper or entry is None:
            return "the graph has no C++ entry point"
        library = getattr(getattr(entry, "__self__", None), "__file__", None)
        if not library:
            return "the graph's C++ entry point is in no shared library"
        # what the compiled call hands the C++ wrapper, and what it makes of its output
        seen: dict[str, Any] = {}

        def recorded(arguments: list[Any]) -> Any:
            seen["arguments"] = list(arguments)
            seen["outputs"] = wrapper(arguments)
            return seen["outputs"]

        graph.current_callable = recorded
        try:
            with torch.inference_mode():
                output = self(**example)
        finally:
            graph.current_callable = wrapper
        given = self._arguments([reader(example) for _, reader in self.readers])
        handed = seen.get("arguments", [])
        if len(handed) != len(given) or any(
            a is not b if isinstance(b, torch.Tensor) else a != b
            for a, b in zip(handed, given, strict=False)
        ):
            return "the compiled call does not hand the wrapper its own arguments"
        outputs = seen["outputs"]
        if len(outputs) != 1 or outputs[0] is not output:
            return "the compiled call changes the wrapper's output"
        return self.bind_entry(library)

    def bind_entry(self, library: str) -> str:
        """Calls the graph from now on through the entry point of ``library``, the shared
        library inductor built for it under its C++ wrapper. Returns why not ("" where it
        does)."""
        from kernels.cpu_ops import load

        if load() == "torch":
            return "the C++ operators are not built"
        if any(argument is not None and not isinstance(argument, torch.Tensor)
               for argument in self.arguments):  # fmt: skip
            return "the module gives the graph an argument that is not a tensor"
        try:
            address = ctypes.cast(ctypes.CDLL(library)[_ENTRY_SYMBOL], ctypes.c_void_p).value
        except (OSError, AttributeError) as error:
            return f"no entry point in {library} ({error})"
        self.entry = torch.classes.splitfuse_cpu.GraphCall(
            address,
            self.arguments,
            [self.readers[position][0] for position in self.tensor_positions],
            [self.readers[position][0] for position in self.size_positions],
            1,
        )
        self.library = library
        return ""

    def fixed_layout(self) -> list[list[Any] | None]:
        """(dtype, sizes, strides) of each argument the module gives (None for the step's): what
        a process that loads the graph checks its own module's against."""
        return [
            None if argument is None
            else [str(argument.dtype), list(argument.shape), list(argument.stride())]
            for argument in self.arguments
        ]  # fmt: skip


def compiling_in_background() -> bool:
    """True while a compile thread runs. It cannot be stopped, and the interpreter's exit
    aborts under it (the compiler's C++ threads): a process that ends then leaves with
    ``os._exit``."""
    return any(
        thread.name == COMPILE_THREAD_NAME and thread.is_alive() for thread in threading.enumerate()
    )


class StepGraphs:
    """Runs ``model(input_ids, positions, plan, sample_rows)``, through compiled graphs once
    they are ready."""

    # what a step that no graph fits does once the graphs are ready (tests make it fail)
    stance = "eager_on_recompile"
    # graphs that need no compiler to run are compiled in a process of their own, given a
    # ``builder`` (tests that look inside the compiled graphs turn it off)
    build_elsewhere = True

    def __init__(
        self,
        model: nn.Module,
        compile: bool,
        unsupported: str = "",
        single_token_graph: bool = True,
        operator_step: Callable[[Any], Any] | None = None,
        builder: GraphBuild | None = None,
        one_token_steps: bool = True,
    ) -> None:
        """``single_token_graph``: also compile the graph of exactly one token (otherwise a
        one-token step must reach the graph padded to two: deterministic mode, whose rows must
        always run the same loops). ``one_token_steps``: False where no step of one token
        reaches these graphs (the runner's decode stack takes every one), so that graph is not
        compiled either (one that still comes runs as a step no graph was made for: through
        the graph of two tokens and up where that fits it, else eagerly).
        ``operator_step(plan)``: the backend's plan of a step as
        tensors alone (None where it has none); given, both graphs take that form (not in
        deterministic mode) and run under inductor's C++ wrapper (no Python between their
        kernels) where their products allow it (``python_wrapper_needed``,
        ``tensor_plan_unsupported``).

        ``builder``: the same model's graphs kept from an earlier start, or compiled in another
        process (``engine/graph_build.py``); used where every graph runs under the C++ wrapper,
        so that this process never imports the compiler (a failed build falls back to
        compiling here)."""
        self.model = model
        self.mode = EAGER
        self.compile_seconds: float | None = None
        # whether the graph of one token is made (and a build gives it)
        self._one_token_graph = single_token_graph and one_token_steps
        self.warm_up_tokens = WARM_UP_TOKENS if self._one_token_graph else WARM_UP_TOKENS[:1]
        self.operator_step = operator_step
        self._stack: Callable[..., torch.Tensor] | None = None
        # set where the graph of two tokens and up takes the plan as tensors too
        self._stack_graphs: _GraphRecorder | None = None
        self._single: Callable[..., torch.Tensor] | None = None
        self._single_graphs: _GraphRecorder | None = None
        # the graphs of one token and of two and up called directly, once compiled (None:
        # through the compiler)
        self.direct: DirectGraph | None = None
        self.stack_direct: DirectGraph | None = None
        # the graphs were compiled in another process: only their entry points are here
        self.loaded = False
        self.builder: GraphBuild | None = None
        self._single_token_graph = single_token_graph
        self._done = threading.Event()
        self._done.set()
        if compile and unsupported:
            logger.info("compile: not used (%s)", unsupported)
        elif compile:
            if (
                builder is not None
                and self.build_elsewhere
                and single_token_graph
                and operator_step is not None
                and not tensor_plan_unsupported(model.model)
            ):
                self.builder = builder
            else:
                self._make_graphs()

    def _make_graphs(self) -> None:
        """The ``torch.compile`` wrappers of the forward (compiled by ``_compile``)."""
        model, operator_step = self.model, self.operator_step
        _set_cache_dir()
        # one whole graph, called by ``DirectGraph`` in place of the forward (checking the
        # step's tensors; the weights never change): without inductor's checks of every
        # argument's and extern output's sizes and strides (~440 a step)
        cpp_wrapper = {"cpp_wrapper": True, "size_asserts": False}
        # deterministic mode (no graph of one token) has no plan as tensors
        tensor_plans = self._single_token_graph and operator_step is not None
        if tensor_plans:
            # where a product needs a Python object (oneDNN's packed weight) the graph keeps a
            # Python wrapper, but it takes the plan as tensors all the same: each layer's
            # attention is then the C++ operator, not the Python one (bfloat16 prefill of the
            # default model on 2 cores of an AMX CPU, alternating processes: ~2% by the medians,
            # 1.5-6% faster in three pairs of runs of four, 3.5% slower in one)
            why = tensor_plan_unsupported(model.model)
            if why:
                logger.info("compile: the graph of two tokens and up keeps a Python wrapper (%s)",
                            why)  # fmt: skip
            self._stack_graphs = _GraphRecorder({} if why else cpp_wrapper)
            self._stack = self._whole_graph(self._stack_graphs)
        else:
            self._plan_object_stack()
        if self._one_token_graph and operator_step is not None:
            why = python_wrapper_needed(model.model)
            if why:
                logger.info("compile: the graph of one token keeps a Python wrapper (%s)", why)
            self._single_graphs = _GraphRecorder({} if why else cpp_wrapper)
            self._single = self._whole_graph(self._single_graphs)

    def _plan_object_stack(self) -> None:
        """The graph of two tokens and up taking the plan object (deterministic mode, or where
        the graph that takes the plan as tensors failed to compile)."""
        self._stack_graphs = None
        self.stack_direct = None
        self._stack = torch.compile(
            _own_forward(self.model.model), dynamic=True, options=_compile_options()
        )

    def _whole_graph(self, recorder: _GraphRecorder) -> Callable[..., torch.Tensor]:
        """The forward compiled as one graph (no break) by ``recorder``, which keeps it."""
        return torch.compile(
            _own_forward(self.model.model),
            dynamic=True,
            fullgraph=True,
            backend=recorder,
            options=_compile_options(),
        )

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        plan: Any,
        sample_rows: torch.Tensor,
    ) -> torch.Tensor:
        if self.mode != COMPILED:
            return self.model(input_ids, positions, plan, sample_rows)
        num_tokens = input_ids.shape[0]
        direct = self.direct if num_tokens == 1 else self.stack_direct
        # a graph called directly exists only where the plan has a tensor form
        tensors = None if direct is None or self.operator_step is None else self.operator_step(plan)
        if direct is not None and tensors is not None:
            hidden = direct(input_ids=input_ids, positions=positions, plan=tensors)
            if hidden is not None:
                return self.model.compute_logits(hidden, sample_rows)
        if self.loaded:  # graphs compiled in another process: no compiler here to make one
            return self.model(input_ids, positions, plan, sample_rows)
        graph, graph_plan = self._graph(num_tokens, plan)
        assert graph is not None
        with torch.compiler.set_stance(self.stance):
            hidden = graph(input_ids, positions, graph_plan)
        return self.model.compute_logits(hidden, sample_rows)

    def _graph(self, num_tokens: int, plan: Any) -> tuple[Callable[..., torch.Tensor] | None, Any]:
        """The compiled forward a step of ``num_tokens`` goes through, and the plan it takes."""
        graph = self._single if num_tokens == 1 else None
        if graph is None and self._stack_graphs is not None:
            graph = self._stack
        if graph is not None:
            assert self.operator_step is not None
            tensors = self.operator_step(plan)
            if tensors is not None:
                return graph, tensors
        return self._stack, plan

    def start(self, dummy_step: Callable[[int, bool], tuple], background: bool = True) -> None:
        """Compiles the graphs; ``dummy_step(num_tokens, decode)`` gives the arguments of a step
        of that many tokens (one prompt, or as many rows decoding one token each) that writes no
        block a request may hold. In the background by default."""
        if self._stack is None and self.builder is None:
            return
        self.mode = COMPILING
        self._done.clear()
        if not background:
            self._compile(dummy_step)
            return
        threading.Thread(
            target=self._compile, args=(dummy_step,), name=COMPILE_THREAD_NAME, daemon=True
        ).start()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until compiling is over (or ``timeout`` seconds); True when it is."""
        return self._done.wait(timeout)

    def _compile(self, dummy_step: Callable[[int, bool], tuple]) -> None:
        start, rss_before = time.perf_counter(), resident_mib()
        if self.builder is not None:
            try:
                how = self._load_from_builder(dummy_step)
            except Exception:  # noqa: BLE001 (any failure of the other process: compile here)
                logger.exception(
                    "compile: the step graphs could not be built in a process of their own; "
                    "compiling them in this one"
                )
                self.builder = None
                self.direct = self.stack_direct = None
                self._make_graphs()
            else:
                self.compile_seconds = time.perf_counter() - start
                self.loaded = True
                self.mode = COMPILED
                self._done.set()
                logger.info(
                    "compile: step graphs ready in %.1f s (%s, called through their entry "
                    "points); resident memory %.0f MiB before, %.0f MiB after",
                    self.compile_seconds,
                    how,
                    rss_before,
                    resident_mib(),
                )
                return
        graphs_before = self.num_graphs()
        try:
            for num_tokens in self.warm_up_tokens:
                # inputs made outside inference mode, as the runner's are: a graph guards on
                # its inputs' dispatch keys, which inference tensors do not share; the graph
                # that takes the plan as tensors is traced over two rows (a dimension of size 1
                # is specialized)
                decode = num_tokens == 1 or self._stack_graphs is not None
                input_ids, positions, plan, _ = dummy_step(num_tokens, decode)
                graph, graph_plan = self._graph(num_tokens, plan)
                try:
                    hidden = self._trace(graph, input_ids, positions, graph_plan)
                    if graph is self._single:
                        self.direct = self._direct_graph(
                            self._single_graphs, input_ids, positions, graph_plan, hidden
                        )
                    elif graph_plan is not plan:
                        self.stack_direct = self._direct_graph(
                            self._stack_graphs, input_ids, positions, graph_plan, hidden
                        )
                except Exception:
                    if graph is self._single:
                        logger.exception(
                            "compile: the graph of one token failed; one-token steps take the "
                            "graph of the other sizes' form instead"
                        )
                        self._single = None
                    elif (
                        graph_plan is not plan
                        and self._stack_graphs is not None
                        and self._stack_graphs.python_wrapper
                    ):
                        logger.exception(
                            "compile: the graph of two tokens and up that takes the plan as "
                            "tensors failed; it takes the plan object instead"
                        )
                        self._plan_object_stack()
                    else:
                        raise
                    input_ids, positions, plan, _ = dummy_step(num_tokens, False)
                    graph, graph_plan = self._graph(num_tokens, plan)
                    self._trace(graph, input_ids, positions, graph_plan)
        except Exception:  # a compiler failure must not take serving down: eager still works
            logger.exception("compile: the step graphs failed to compile; running eager")
            self.mode = EAGER
            self._done.set()
            return
        self.compile_seconds = time.perf_counter() - start
        self.mode = COMPILED
        self._done.set()
        gc.collect()
        release_free_memory()  # the compiler's freed work (~10 MiB of the default model's)
        logger.info(
            "compile: step graphs ready in %.1f s (%d graphs; caches in %s); resident memory "
            "%.0f MiB before, %.0f MiB after",
            self.compile_seconds,
            self.num_graphs() - graphs_before,
            os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
            rss_before,
            resident_mib(),
        )

    def _load_from_builder(self, dummy_step: Callable[[int, bool], tuple]) -> str:
        """Loads the graphs kept from an earlier start where they fit, else builds them in
        another process, loads them and keeps them; says which. Raises where the build or the
        load fails."""
        assert self.builder is not None
        kept = self.builder.cached()
        if kept is not None:
            try:
                self._load_built(kept, dummy_step)
                return "kept from an earlier start"
            except Exception as error:  # noqa: BLE001 (the kept ones do not fit: build again)
                logger.info(
                    "compile: the step graphs kept from an earlier start do not fit (%s); "
                    "building them again",
                    error,
                )
                self.direct = self.stack_direct = None
        manifest = self.builder.build()
        self._load_built(manifest, dummy_step)
        self.builder.keep(manifest)
        return "built in a process of their own"

    def _load_built(
        self, manifest: dict[str, Any], dummy_step: Callable[[int, bool], tuple]
    ) -> None:
        """Loads the graphs of ``manifest``, compiled elsewhere: each graph's arguments are
        read from this model through the sources the compiler recorded there, checked to be
        laid out as there, and the graph's output on a dummy step checked to be, bit for bit,
        what it gave there (the same code on the same weights and inputs). Raises where any of
        it fails."""
        loaded: dict[str, DirectGraph] = {}
        for graph in manifest["graphs"]:
            kind = graph["kind"]
            example = self._example(dummy_step, kind)
            direct = DirectGraph(None, graph["sources"], self.model.model, example)
            if direct.fixed_layout() != graph["fixed"]:
                raise RuntimeError(
                    f"the graph of {kind} was compiled for weights laid out otherwise"
                )
            why = direct.bind_entry(graph["library"])
            if why:
                raise RuntimeError(f"the graph of {kind}: {why}")
            with torch.inference_mode():
                output = direct(**example)
            expected = torch.tensor(graph["output"], dtype=torch.float32)
            if output is None or not torch.equal(output.float(), expected):
                raise RuntimeError(
                    f"the graph of {kind} does not give the output it gave where it was built"
                )
            loaded[kind] = direct
        if set(loaded) != set(self._kinds()):
            raise RuntimeError(f"the build gave the graphs {sorted(loaded)}")
        self.direct, self.stack_direct = loaded.get("single"), loaded["stack"]

    def _kinds(self) -> tuple[str, ...]:
        """The graphs a build gives: "single" (one token) where steps of one token reach them,
        and "stack" (two tokens and up)."""
        return ("single", "stack") if self._one_token_graph else ("stack",)

    def _example(self, dummy_step: Callable[[int, bool], tuple], kind: str) -> dict[str, Any]:
        """The forward's arguments (by name) of the dummy step a graph of ``kind`` ("single":
        one token; "stack": two and up) is checked on: two rows decoding for the latter."""
        input_ids, positions, plan, _ = dummy_step(1 if kind == "single" else 2, True)
        assert self.operator_step is not None
        tensors = self.operator_step(plan)
        parameters = list(inspect.signature(self.model.model.forward).parameters)
        return dict(zip(parameters, (input_ids, positions, tensors), strict=True))

    def manifest(self, dummy_step: Callable[[int, bool], tuple]) -> dict[str, Any]:
        """Where each compiled graph's library is, what it takes and what it gives on its dummy
        step (``_load_built`` reads it in another process). Raises where a graph does not run
        under the C++ wrapper."""
        graphs = []
        built = {"single": self.direct, "stack": self.stack_direct}
        for kind in self._kinds():
            direct = built[kind]
            if direct is None or direct.library is None:
                raise RuntimeError(f"the graph of {kind} has no C++ entry point")
            with torch.inference_mode():
                output = direct(**self._example(dummy_step, kind))
            assert output is not None
            graphs.append(
                {
                    "kind": kind,
                    "library": direct.library,
                    "sources": direct.sources,
                    "fixed": direct.fixed_layout(),
                    "output": output.float().tolist(),  # exact: float32 holds every value
                }
            )
        return {"graphs": graphs}

    def _trace(
        self,
        graph: Callable[..., torch.Tensor] | None,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        plan: Any,
    ) -> torch.Tensor:
        """Compiles ``graph`` for the shapes of these inputs by running it once; its output."""
        assert graph is not None
        num_tokens = input_ids.shape[0]
        plan_is_opaque = not isinstance(plan, tuple)
        # size-oblivious: the 2 of the trace is not specialized as "not 1"; no duck sizing in
        # the graphs that take the plan as tensors: their KV cache and tables are inputs, and a
        # size they share in the dummy step (2 blocks, the K/V pair) is no rule of real steps
        with (
            torch.inference_mode(),
            torch.fx.experimental._config.patch(
                backed_size_oblivious=num_tokens > 1, use_duck_shape=plan_is_opaque
            ),
            # a graph that cannot be made is an error here, never a silent eager run
            torch._dynamo.config.patch(fail_on_recompile_limit_hit=True),
        ):
            return graph(input_ids, positions, plan)

    def _direct_graph(
        self,
        recorder: _GraphRecorder | None,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        plan: Any,
        traced: torch.Tensor,
    ) -> DirectGraph | None:
        """The graph ``recorder`` holds (of one token, or of two tokens and up) as a
        ``DirectGraph``, checked against the traced call's output on the same inputs; None
        (logged) where it cannot be one."""
        assert recorder is not None
        what = "one token" if recorder is self._single_graphs else "two tokens and up"
        if len(recorder.graphs) != 1:
            logger.info(
                "compile: the graph of %s runs through the compiler (%d graphs made)",
                what,
                len(recorder.graphs),
            )
            return None
        sources, compiled = recorder.graphs[0]
        parameters = list(inspect.signature(self.model.model.forward).parameters)
        example = dict(zip(parameters, (input_ids, positions, plan), strict=True))
        try:
            direct = DirectGraph(compiled, sources, self.model.model, example)
        except ValueError as error:
            logger.info("compile: the graph of %s runs through the compiler (%s)", what, error)
            return None
        with torch.inference_mode():
            output = direct(**example)
        if output is None or not torch.equal(output, traced):
            logger.warning(
                "compile: the graph of %s called directly does not give its traced output; it "
                "runs through the compiler",
                what,
            )
            return None
        if recorder.config_patches.get("cpp_wrapper"):
            why = direct.use_entry_point(example)
            if not why:
                with torch.inference_mode():
                    output = direct(**example)
                if output is None or not torch.equal(output, traced):
                    why = "its output through the entry point is not the traced one"
            if why:
                direct.entry = None
                logger.info("compile: the graph of %s is called from Python (%s)", what, why)
        return direct

    @staticmethod
    def num_graphs() -> int:
        """Graphs compiled in this process so far (every model's)."""
        return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
