"""`MeasuredChoice`: each option is timed over the first steps (a warm-up each, not counted, then
rounds in turn) and the fastest is kept, the default on a tie; a slow step from elsewhere on the
machine does not decide."""

import pytest

from pipekit.pipelining.runtime.measured_choice import ROUNDS, MeasuredChoice, trial_order


class _Clock:
    """Steps that last what the test says for the option they run (`seconds[i]`); warm-ups
    take far longer, and the first timed step of each option is slower by `noise`."""

    def __init__(self, holder: list[MeasuredChoice], seconds: list[float], noise: float) -> None:
        self.now, self.holder, self.seconds, self.noise = 0.0, holder, seconds, noise
        self.started = False

    def __call__(self) -> float:
        if self.started:  # the step's end: advance by its length
            choice = self.holder[0]
            step = len(choice.step_seconds)
            options = len(choice.options)
            if step < options:
                length = 100.0
            else:
                length = self.seconds[choice.current_index]
                length += self.noise if step < 2 * options else 0.0
            self.now += length
        self.started = not self.started
        return self.now


def _run(options, seconds, default=0, noise=5.0, extra_steps=2):
    holder: list[MeasuredChoice] = []
    choice = MeasuredChoice(
        "layout", None, options, default=default, clock=_Clock(holder, seconds, noise)
    )
    holder.append(choice)
    ran = []
    for _ in range(len(choice.trials) + extra_steps):
        ran.append(choice.current)
        choice.begin_step()
        choice.end_step()
    return choice, ran


@pytest.mark.parametrize(
    ("seconds", "chosen"), [([1.0, 1.2, 1.1], "a"), ([1.2, 1.0, 1.1], "b"), ([1.2, 1.1, 0.9], "c")]
)
def test_the_fastest_option_is_kept_after_the_trials(seconds, chosen):
    choice, ran = _run(("a", "b", "c"), seconds)
    order = trial_order(3)
    assert order == (0, 1, 2) * (1 + ROUNDS)
    assert ran == [("a", "b", "c")[index] for index in order] + [chosen, chosen]
    assert choice.chosen == chosen
    expected = ", ".join(f"{s:.3f} s {label}" for label, s in zip("abc", seconds, strict=True))
    assert choice.reason == f"fastest step {expected}"


def test_a_tie_keeps_the_default_and_false_is_a_choice():
    choice, ran = _run((True, False), [1.0, 1.0], default=1)
    assert choice.chosen is False and ran[-2:] == [False, False]
    choice, _ = _run((True, False), [1.0, 1.0], default=0)
    assert choice.chosen is True


def test_nothing_is_decided_before_the_last_trial():
    choice, ran = _run(("a", "b"), [2.0, 1.0], extra_steps=-1)
    assert ran == (["a", "b"] * (1 + ROUNDS))[:-1]  # every trial step but the last ran
    assert choice.chosen is None and choice.chosen_index is None
    with pytest.raises(ValueError, match="two options or more"):
        MeasuredChoice("layout", None, ("a",))
