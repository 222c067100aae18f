"""fedjx-plot: learning curves of runs in one PNG; every mistake is one line."""

import configparser
import json
import os

import pytest

from fedjx.experiments import plot_cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def runs(tmp_path):
  for name, acc in (('a', 0.5), ('b', 0.7)):
    d = tmp_path / name
    d.mkdir()
    with open(d / 'metrics.jsonl', 'w', encoding='utf-8') as f:
      for r in range(3):
        f.write(json.dumps({'round': r, 'loss': 1.0 / (r + 1),
                            'eval_accuracy': acc + 0.1 * r}) + '\n')
  return tmp_path


def _main(capsys, *args):
  with pytest.raises(SystemExit) as e:
    plot_cli.main(list(args))
  return e.value.code, capsys.readouterr().err


def test_the_command_is_installed():
  setup = configparser.ConfigParser()
  setup.read(os.path.join(REPO, 'setup.cfg'))
  scripts = setup['options.entry_points']['console_scripts']
  assert 'fedjx-plot = fedjx.experiments.plot_cli:main' in scripts


def test_writes_the_png_of_several_runs(runs, capsys):
  out = runs / 'cmp.png'
  plot_cli.main([str(runs / 'a'), str(runs / 'b'), '--out', str(out),
                 '--metrics', 'eval_accuracy', '--labels', 'A,B'])
  assert capsys.readouterr().out.strip() == str(out)
  with open(out, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'


@pytest.mark.parametrize('args,line', [
    (['{d}/none'], "fedjx-plot: no such run directory or metrics file '{d}/none'."),
    (['{d}'], 'fedjx-plot: {d} holds neither metrics.jsonl nor metrics.csv; is it '
     'a fedjx-run workdir?'),
    (['{d}/a', '--metrics', 'eval_acc'],
     "fedjx-plot: --metrics: no run reports 'eval_acc'. Did you mean "
     "'eval_accuracy'? The runs report: ['eval_accuracy', 'loss']."),
    (['{d}/a', '--x', 'simulated_time'],
     "fedjx-plot: --x: no run reports 'simulated_time'. The runs report: "
     "['eval_accuracy', 'loss']."),
    (['{d}/a', '{d}/b', '--labels', 'A'],
     'fedjx-plot: --labels gives 1 labels for 2 runs; give one per run.'),
    (['{d}/a', '--out', '{d}/a/metrics.jsonl/x.png'],
     "fedjx-plot: --out='{d}/a/metrics.jsonl/x.png' cannot be written (File "
     "exists); choose another --out."),
])
def test_every_mistake_is_one_line_with_exit_status_2(runs, capsys, args, line):
  code, err = _main(capsys, *[a.format(d=runs) for a in args])
  assert code == 2
  assert err.strip() == line.format(d=runs)


def test_debug_shows_the_traceback(runs):
  with pytest.raises(plot_cli.PlotError):
    plot_cli.main([str(runs / 'none'), '--debug'])
