"""The hook timing of benchmarks/profile_host_step.py: a hook's own time is its time less the wrapped method's."""

import functools

import pytest
from benchmark_module import load

php = load("profile_host_step")


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(php, "time", fake)
    return fake


def _hooked_class(clock, hook_cost, vllm_cost, static=False):
    """A class whose method ``step`` is wrapped the way vllm_glue._wrap wraps vLLM methods."""
    def step(*args):
        clock.now += vllm_cost
        return "vllm"

    def make(original):
        def step(*args):
            clock.now += hook_cost
            return original(*args)
        return step

    wrapped = functools.wraps(step)(make(step))
    wrapped._hotwire = True
    return type("Runner", (), {"step": staticmethod(wrapped) if static else wrapped})


@pytest.mark.parametrize("static", [False, True])
def test_a_hooks_own_time_leaves_out_the_method_it_wraps(clock, static):
    cls = _hooked_class(clock, hook_cost=3.0, vllm_cost=10.0, static=static)
    timer = php.time_hook(cls, "step", vars(cls)["step"])
    obj = cls()
    assert obj.step() == "vllm" and obj.step() == "vllm"
    assert timer.own == pytest.approx([3.0, 3.0])
    assert timer.name == "Runner.step"
    timer.reset()
    assert timer.own == []


def test_nested_hooks_each_keep_their_own_time(clock):
    inner_cls = _hooked_class(clock, hook_cost=2.0, vllm_cost=5.0)
    inner_timer = php.time_hook(inner_cls, "step", vars(inner_cls)["step"])
    inner = inner_cls()

    def run(*args):  # a vLLM method that calls another hooked one, as execute_model calls _model_forward
        clock.now += 1.0
        return inner.step()

    def make(original):
        def run_hook(*args):
            clock.now += 4.0
            return original(*args)
        return run_hook

    hook = functools.wraps(run)(make(run))
    hook._hotwire = True
    outer_cls = type("Outer", (), {"run": hook})
    outer_timer = php.time_hook(outer_cls, "run", hook)
    outer_cls().run()
    assert outer_timer.own == pytest.approx([4.0]) and inner_timer.own == pytest.approx([2.0])


def test_a_hook_without_the_method_in_its_own_closure_is_left_untimed(clock):
    def capture(*args):
        return None

    def outer(original):
        def two_passes(*args):
            return original(*args)
        return two_passes

    def inner(original):
        def capture(*args):
            return original(*args)
        return capture

    hook = functools.wraps(capture)(outer(inner(capture)))
    cls = type("Manager", (), {"capture": hook})
    assert php.time_hook(cls, "capture", hook) is None
    assert vars(cls)["capture"] is hook


def test_a_hook_re_entered_from_its_own_method_subtracts_only_what_it_called(clock):
    """V1's FULL-graph CUDAGraphWrapper runs the model, whose piecewise graphs are CUDAGraphWrappers too."""
    def call(self, depth):
        clock.now += 10.0
        return self.call(depth - 1) if depth else "vllm"

    def make(original):
        def call(self, depth):
            clock.now += 1.0 + depth  # outer 2 µs, inner 1 µs
            return original(self, depth)
        return call

    hook = functools.wraps(call)(make(call))
    hook._hotwire = True
    cls = type("CUDAGraphWrapper", (), {"call": hook})
    timer = php.time_hook(cls, "call", hook)
    assert cls().call(1) == "vllm"
    assert timer.own == pytest.approx([1.0, 2.0])  # inner first; the outer's own is not reduced by the inner's method


def _called_in(steps):
    timer = php.HookTimer("hook")
    timer.steps = steps
    return timer


def test_per_step_hooks_run_once_in_most_steps():
    assert php.per_step(_called_in(list(range(1, 66))), 65) and php.per_step(_called_in(list(range(3, 66))), 65)
    assert not php.per_step(_called_in([1, 1] + list(range(2, 66))), 65)  # twice in one step
    assert not php.per_step(_called_in([1] * 37), 65)  # 37 piecewise graphs of the one prefill step
    assert not php.per_step(_called_in([]), 65)


def test_calls_are_stamped_with_the_engine_step(clock):
    schedule_cls = _hooked_class(clock, hook_cost=1.0, vllm_cost=1.0)
    runner_cls = _hooked_class(clock, hook_cost=1.0, vllm_cost=1.0)
    schedule = php.time_hook(schedule_cls, "step", vars(schedule_cls)["step"])
    schedule.name = "Scheduler.schedule"
    forward = php.time_hook(runner_cls, "step", vars(runner_cls)["step"])
    php.count_steps([schedule, forward])
    for _ in range(3):
        schedule_cls().step()
        runner_cls().step()
    assert forward.steps == [1, 2, 3] and php.per_step(forward, 3)


def test_parts_are_timed_whole(clock):
    def method(cost):
        def run(self, *args):
            clock.now += cost
            return cost
        return run

    names = php.PARTS["WorkerSteering"] + php.PARTS["Uploader"]
    costs = iter(float(i + 1) for i in range(len(names)))
    classes = [type(c, (), {name: method(next(costs)) for name in php.PARTS[c]}) for c in ("WorkerSteering", "Uploader")]
    timers = php.time_parts(*classes)
    results = [getattr(cls(), name)() for cls in classes for name in php.PARTS[cls.__name__]]
    expected = [float(i + 1) for i in range(len(names))]
    assert results == expected
    assert [t.name for t in timers] == [f"part: {c.__name__}.{n}" for c in classes for n in php.PARTS[c.__name__]]
    assert [t.own for t in timers] == [[cost] for cost in expected]
