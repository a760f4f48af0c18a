"""torch's mode stacks are per ubatch: TorchFunctionMode and TorchDispatchMode stacks (infra modes
such as FakeTensorMode included), the default device and saved-tensor hooks.

The oracle is the one ``test_context_modes.py`` uses: each ubatch's program (entering and leaving
modes, ``with torch.device(...)`` blocks and saved-tensor-hook blocks that span yields, and
``torch.set_default_device`` calls) first runs alone, outside any run, where ``dbo_yield`` is a
no-op, from the caller's state; what it observes after every step is the reference. The same
programs then run interleaved in one ``run_ubatches``: every ubatch must observe exactly the same,
and the caller's stacks (the very mode objects) must be what they were afterwards, failure or
not.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
import torch.utils._device as torch_device
from hypothesis import given, note, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import disable_saved_tensors_hooks, saved_tensors_hooks
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    is_in_torch_dispatch_mode,
)

from dbo import UBatchError, dbo_yield, run_ubatches

_autograd = torch._C._autograd


class TagFunctionMode(TorchFunctionMode):
    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class TagDispatchMode(TorchDispatchMode):
    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def tag_hook(tag: str):
    def pack(t):
        return t

    pack.tag = tag
    return pack


def unpack(t):
    return t


def name(mode) -> str:
    if isinstance(mode, DeviceContext):
        return f"device:{mode.device}"
    if isinstance(mode, FakeTensorMode):
        return "fake"
    return mode.tag


def saved_hooks() -> list:
    """The saved-tensor hooks stack, bottom first (read by popping and pushing back)."""
    disabled = _autograd._saved_tensors_hooks_get_disabled_error_message()
    if disabled is not None:
        _autograd._saved_tensors_hooks_enable()
    hooks = []
    while (top := _autograd._top_saved_tensors_default_hooks(True)) is not None:
        hooks.append(top)
        _autograd._pop_saved_tensors_default_hooks()
    hooks.reverse()
    for pack, unpack_ in hooks:
        _autograd._push_saved_tensors_default_hooks(pack, unpack_)
    if disabled is not None:
        _autograd._saved_tensors_hooks_disable(disabled, False)
    return hooks


def raw_state() -> tuple:
    """This thread's stacks as the mode objects themselves, and the globals that go with them."""
    return (tuple(_get_current_function_mode_stack()), tuple(_get_current_dispatch_mode_stack()),
            tuple(saved_hooks()), _autograd._saved_tensors_hooks_get_disabled_error_message(),
            getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None),
            torch_device.CURRENT_DEVICE, is_in_torch_dispatch_mode(),
            is_in_torch_dispatch_mode(False),
            torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.Python),
            torch.is_grad_enabled(), torch.is_inference_mode_enabled())


def observe() -> tuple:
    """What a ubatch sees: the stacks by name, the default device and where a new tensor goes."""
    (functions, dispatch, hooks, disabled, device_context, current_device, in_mode,
     in_user_mode, python_key, grad, inference) = raw_state()
    return ([name(m) for m in functions], [name(m) for m in dispatch],
            [pack.tag for pack, _ in hooks], disabled,
            None if device_context is None else str(device_context.device),
            str(current_device), in_mode, in_user_mode, python_key, grad, inference,
            _device_or_error(torch.get_default_device), _device_or_error(lambda: torch.empty(0).device))


def _device_or_error(get) -> str:
    try:
        return str(get())
    except AssertionError as err:  # FakeTensorMode refuses some of it on a meta default device
        return type(err).__name__


OPS = st.sampled_from([
    ("yield",), ("yield",), ("yield",), ("pop",), ("pop",),
    ("function",), ("dispatch",), ("fake",), ("device", "meta"), ("device", "cpu"),
    ("hooks",), ("nohooks",), ("default", "meta"), ("default", "cpu"), ("default", None),
    ("inference", True), ("no_grad",),
])


def interpret(ub: int, program, caller_hooks: int, log: list, fail_at: int | None = None):
    """Ubatch ``ub`` runs ``program``; ops that torch would refuse in the ubatch's own state
    (by its own bookkeeping, never by reading torch) are skipped, alone and interleaved alike."""

    def fn():
        with ExitStack() as stack:
            blocks: list[tuple[str, ExitStack]] = []
            for i, op in enumerate(program):
                if i == fail_at:
                    raise ValueError("planned failure")
                kind, tag = op[0], f"ub{ub}.{i}"
                kinds = [k for k, _ in blocks]
                if kind == "yield":
                    dbo_yield()
                elif kind == "pop":
                    if blocks:
                        blocks.pop()[1].close()
                elif kind == "default":
                    # set_default_device re-stacks the function modes, which a `with torch.device`
                    # block then pops the wrong one of (torch's rule, not dbo's).
                    if "device" not in kinds:
                        torch.set_default_device(op[1])
                elif kind == "hooks" and "nohooks" in kinds:
                    pass  # torch refuses hooks while they are disabled
                elif kind == "nohooks" and (caller_hooks or "hooks" in kinds):
                    pass  # torch refuses to disable hooks while some are pushed
                else:
                    inner = ExitStack()
                    if kind == "function":
                        inner.enter_context(TagFunctionMode(tag))
                    elif kind == "dispatch":
                        inner.enter_context(TagDispatchMode(tag))
                    elif kind == "fake":
                        inner.enter_context(FakeTensorMode())
                    elif kind == "device":
                        inner.enter_context(torch.device(op[1]))
                    elif kind == "hooks":
                        inner.enter_context(saved_tensors_hooks(tag_hook(tag), unpack))
                    elif kind == "nohooks":
                        inner.enter_context(disable_saved_tensors_hooks(tag))
                    elif kind == "inference":
                        inner.enter_context(torch.inference_mode(op[1]))
                    else:
                        inner.enter_context(torch.no_grad())
                    blocks.append((kind, inner))
                    stack.callback(inner.close)  # closed on the way out if still open
                log.append((i, op, observe()))
            while blocks:
                blocks.pop()[1].close()
            log.append(("end", observe()))

    return fn


CALLER = st.fixed_dictionaries({
    "function": st.booleans(), "dispatch": st.booleans(), "hooks": st.booleans(),
    "default": st.sampled_from([None, "cpu", "meta"]), "inference": st.booleans(),
})


@st.composite
def cases(draw):
    n = draw(st.integers(2, 3))
    programs = [draw(st.lists(OPS, max_size=12)) for _ in range(n)]
    return programs, draw(CALLER)


def enter_caller_state(stack: ExitStack, caller: dict) -> None:
    if caller["default"] is not None:
        torch.set_default_device(caller["default"])
        stack.callback(torch.set_default_device, None)
    if caller["function"]:
        stack.enter_context(TagFunctionMode("caller.function"))
    if caller["dispatch"]:
        stack.enter_context(TagDispatchMode("caller.dispatch"))
    if caller["hooks"]:
        stack.enter_context(saved_tensors_hooks(tag_hook("caller.hooks"), unpack))
    stack.enter_context(torch.inference_mode(caller["inference"]))


def alone(programs, caller) -> list[list]:
    logs = []
    for ub, program in enumerate(programs):
        log: list = []
        with ExitStack() as stack:
            enter_caller_state(stack, caller)
            interpret(ub, program, caller["hooks"], log)()
            torch.set_default_device(caller["default"])  # what the program set, undone
        logs.append(log)
    return logs


def run_interleaved(programs, caller, logs, failing: int | None = None, at: int | None = None):
    fns = [interpret(ub, p, caller["hooks"], log, at if ub == failing else None)
           for ub, (p, log) in enumerate(zip(programs, logs, strict=True))]
    with ExitStack() as stack:
        enter_caller_state(stack, caller)
        before = raw_state()
        try:
            run_ubatches(fns, device="cpu")
        except UBatchError as err:
            assert failing is not None and isinstance(err.__cause__, ValueError), err
        assert raw_state() == before, "the caller's mode stacks changed"


EMPTY = raw_state()


@settings(max_examples=max(settings.default.max_examples, 200))
@given(cases())
def test_each_ubatch_sees_its_own_mode_stacks(case):
    programs, caller = case
    note(f"caller: {caller}")
    for i, p in enumerate(programs):
        note(f"ub{i}: {p}")
    expected = alone(programs, caller)
    assert raw_state() == EMPTY
    logs: list[list] = [[] for _ in programs]
    run_interleaved(programs, caller, logs)
    for i, (got, want) in enumerate(zip(logs, expected, strict=True)):
        assert got == want, f"ub{i} saw other mode stacks interleaved than alone"
    assert raw_state() == EMPTY


@given(cases(), st.integers(0, 2), st.integers(0, 12))
def test_a_failed_run_restores_the_callers_mode_stacks(case, failing, at):
    programs, caller = case
    failing %= len(programs)
    run_interleaved(programs, caller, [[] for _ in programs], failing, at)
    assert raw_state() == EMPTY


def test_modes_a_ubatch_never_leaves_stay_with_it():
    # Entered and never exited: the ubatch keeps them to its end, the peer never sees them,
    # and the caller gets its own stacks back.
    seen = {}

    def ub0():
        TagFunctionMode("leak.function").__enter__()
        TagDispatchMode("leak.dispatch").__enter__()
        saved_tensors_hooks(tag_hook("leak.hooks"), unpack).__enter__()
        torch.set_default_device("meta")
        dbo_yield()
        seen[0] = observe()

    def ub1():
        seen[1] = observe()
        dbo_yield()

    before = raw_state()
    run_ubatches([ub0, ub1], device="cpu")
    assert raw_state() == before
    assert seen[1] == observe()
    assert seen[0][:3] == (["device:meta", "leak.function"], ["leak.dispatch"], ["leak.hooks"])
    assert seen[0][-1] == "meta"
