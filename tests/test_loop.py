"""The shared training loop (fedjx.experiments.loop), with a recording trainer."""

import pytest

from fedjx.experiments import loop


class FakeCheckpointer:
  """Records saves and waits; restores what was saved."""

  def __init__(self, calls):
    self.calls, self.saved = calls, {}

  def save(self, step, state, meta, force=False):
    self.calls.append(('save', step, force))
    self.saved[step] = (state, dict(meta))

  def wait(self):
    self.calls.append(('wait',))

  def restore(self, step, like):
    del like
    return self.saved[step]


class RecordingTrainer:
  """State = rounds run so far; every call is recorded in order."""

  def __init__(self, calls, stop_after=None, flag=None, fail_at=None):
    self.calls, self.state = calls, 0
    self._stop_after, self._flag, self._fail_at = stop_after, flag, fail_at
    self.closed = False

  def cohorts(self, start, stop):
    def gen():
      try:
        for r in range(start, stop):
          yield f'cohort{r}'
      finally:
        self.closed = True
    return gen()

  def dispatch(self, r, cohort):
    assert cohort == f'cohort{r}'
    self.calls.append(('dispatch', r))
    self.state += 1
    return {'r': r}

  def collect(self, r, cohort, metrics):
    self.calls.append(('collect', r))
    return dict(metrics)

  def evaluate(self, step, rows):
    self.calls.append(('evaluate', step))

  def record(self, step, rows):
    self.calls.append(('record', step))
    if step == self._fail_at:
      raise RuntimeError(f'stop at {step}')

  def meta(self, step):
    return {'step': step}

  def flush(self):
    self.calls.append(('flush',))

  def after(self, step, rows):
    self.calls.append(('after', step))
    if step == self._stop_after:
      self._flag.signum = 15


def test_the_loop_orders_a_round_s_steps():
  calls = []
  ckpt = FakeCheckpointer(calls)
  trainer = RecordingTrainer(calls)
  saves = loop.Checkpoints(ckpt)
  schedule = loop.Schedule(rounds=3, stop=3, eval_every=10, checkpoint_every=2)
  step, interrupted = loop.train(trainer, saves, schedule, 0, loop.StopFlag())
  assert (step, interrupted, trainer.state) == (3, False, 3)
  assert calls == [
      ('dispatch', 0), ('collect', 0), ('evaluate', 1), ('record', 1), ('after', 1),
      # Round 2 is dispatched before the wait for step 2's save: they overlap.
      ('dispatch', 1), ('collect', 1), ('evaluate', 2), ('record', 2),
      ('flush',), ('save', 2, False), ('after', 2),
      ('dispatch', 2), ('wait',), ('collect', 2), ('evaluate', 3), ('record', 3),
      ('flush',), ('save', 3, False), ('after', 3)]
  assert saves.saved == 3 and trainer.closed
  assert ckpt.saved[2] == (2, {'step': 2})


def test_a_signal_ends_the_loop_after_its_round_with_a_forced_save():
  calls, flag = [], loop.StopFlag()
  trainer = RecordingTrainer(calls, stop_after=1, flag=flag)
  saves = loop.Checkpoints(FakeCheckpointer(calls))
  schedule = loop.Schedule(rounds=5, stop=5, eval_every=1, checkpoint_every=4)
  step, interrupted = loop.train(trainer, saves, schedule, 0, flag)
  assert (step, interrupted) == (1, True) and trainer.closed
  calls.clear()
  loop.interrupt(trainer, saves, step)
  assert calls == [('flush',), ('save', 1, True), ('wait',)]
  assert saves.saved == 1


def test_a_signal_in_the_last_round_is_no_interruption():
  calls, flag = [], loop.StopFlag()
  trainer = RecordingTrainer(calls, stop_after=2, flag=flag)
  saves = loop.Checkpoints(FakeCheckpointer(calls))
  step, interrupted = loop.train(trainer, saves, loop.Schedule(2, 2, 1, 1), 0, flag)
  assert (step, interrupted) == (2, False)


def test_a_trainer_that_stops_the_run_closes_its_cohorts_and_saves_nothing_after():
  calls = []
  trainer = RecordingTrainer(calls, fail_at=2)
  saves = loop.Checkpoints(FakeCheckpointer(calls))
  with pytest.raises(RuntimeError, match='stop at 2'):
    loop.train(trainer, saves, loop.Schedule(4, 4, 1, 2), 0, loop.StopFlag())
  assert trainer.closed and not any(c[0] == 'save' for c in calls)
  assert saves.saved is None


def test_resumed_loop_starts_at_its_step_and_restores_the_saved_state():
  calls = []
  ckpt = FakeCheckpointer(calls)
  ckpt.saved[2] = ('state after 2', {'step': 2})
  saves = loop.Checkpoints(ckpt, saved=2)
  assert saves.restore_saved(None) == ('state after 2', {'step': 2})
  trainer = RecordingTrainer(calls)
  step, _ = loop.train(trainer, saves, loop.Schedule(4, 4, 1, 10), 2, loop.StopFlag())
  assert step == 4 and [c[1] for c in calls if c[0] == 'dispatch'] == [2, 3]
  assert loop.Checkpoints(ckpt).restore_saved(None) is None


@pytest.mark.parametrize('step,evaluates,checkpoints', [
    (1, False, False), (3, True, False), (4, False, True), (6, True, False),
    (7, True, True), (10, True, True)])
def test_the_schedule_includes_multiples_the_budget_s_stop_and_the_last_round(
    step, evaluates, checkpoints):
  schedule = loop.Schedule(rounds=10, stop=7, eval_every=3, checkpoint_every=4)
  assert schedule.evaluates(step) == evaluates
  assert schedule.checkpoints(step) == checkpoints
