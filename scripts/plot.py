"""Overlays the learning curves of several runs into one PNG (the same as the
``fedjx-plot`` command, :mod:`fedjx.experiments.plot_cli`).

  python scripts/plot.py runs/diloco_k4 runs/diloco_k1 --out runs/diloco.png \
      --metrics eval_loss,eval_accuracy
"""

from fedjx.experiments import plot_cli

if __name__ == '__main__':
  plot_cli.main()
