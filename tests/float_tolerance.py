"""Tolerances of float32 comparisons, derived from the computation.

A float32 sum of ``n`` terms, computed in any order, differs from the exact
sum by at most ``gamma_n * sum_i |x_i|`` with ``gamma_n = n u / (1 - n u)``
and ``u = 2**-24`` the unit roundoff (Higham, "Accuracy and Stability of
Numerical Algorithms", 2nd ed., Lemma 3.1 and eq. 4.4; a dot product of
length ``n`` is the same bound with ``x_i = a_i b_i``). So:

* two float32 computations of the same sum (a hand-written reference and an
  XLA kernel that orders the terms differently) differ by at most
  ``2 gamma_n sum_i |x_i|``: an *absolute* bound, scaled by the sum of the
  magnitudes, not by the result, which may cancel to near zero;
* a chain of such sums (a convolution, then a sum of squares of its output)
  adds the ``n`` of each stage, to first order;
* when all terms have one sign (sums of squares, of example counts, of
  non-negative losses) ``sum |x_i| = |sum x_i|`` and the bound is relative:
  ``rtol = 2 gamma_n``.

Tests state ``n`` (and where needed the magnitudes) next to each comparison.
"""

from __future__ import annotations

U32 = 2.0 ** -24


def gamma(n: float) -> float:
  """``gamma_n = n u / (1 - n u)`` for float32."""
  return n * U32 / (1.0 - n * U32)


def rtol(n: float) -> float:
  """Relative difference of two float32 sums of ``n`` same-sign terms."""
  return 2.0 * gamma(n)


def atol(n: float, abs_sum) -> float:
  """Absolute difference of two float32 sums of ``n`` terms of magnitudes summing to ``abs_sum``."""
  return 2.0 * gamma(n) * abs_sum
