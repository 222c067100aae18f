"""The review figures of the algorithm layer, measured from the source.

Prints one JSON line per figure (docs/architecture.md, "The algorithm
layer, measured"), read from a source tree with ``ast`` and text search
(nothing is imported or run):

* ``kit_names``: the names ``algorithms/kit.py`` exports (its ``__all__``);
* ``algorithm_lines``: per ``algorithms/*_lib.py``, its code lines (not
  blank, not comments, not docstrings) and those of its builders (the
  functions the module's ``__all__`` lists that return an algorithm);
* ``state_types``: ``NamedTuple`` classes named ``*State`` in the
  algorithm modules that hold a server model (a ``params`` field);
* ``trait_reads``: the places outside ``algorithms/traits.py`` that read a
  declared trait (an attribute of a ``Traits`` record, or the name-keyed
  tables and ``== '<algorithm>'`` tests that stood for one);
* ``option_checks``: the places that check a FedAvg option's value
  (``weighting``, ``skip_nonfinite``, ``client_metrics``, the local
  schedule, the optimizers), and the places that rewrite a builder's
  signature or take its options by name (``with_options``,
  ``take_options``);
* ``deploy_edges``: the imports in ``fedjx/deploy/`` of the experiments
  layer (``fedjx.experiments``);
* ``deferred_imports``: the imports written inside a function body, by the
  reason their ``# deferred: <reason>`` comment gives (``optional
  dependency``, ``cycle``, ``before JAX``, grouped by these first words;
  ``none given`` without one).

  python scripts/algorithm_layer_figures.py [ROOT]
"""

from __future__ import annotations

import ast
import io
import json
import pathlib
import re
import sys
import tokenize

TRAIT_FIELDS = ('population', 'client_state', 'asynchronous',
                'updates_reach_params', 'indexed_batches', 'unprivatized',
                'aggregates_whole_model', 'replicas_restart', 'checks_update',
                'needs_all_updates', 'wire_bits', 'privacy', 'unbiased',
                'omniscient', 'forwards_to', 'runner_options')
NAME_TABLES = ('CHURN_ALGORITHMS', 'AUDITABLE', 'DP_AGGREGATORS',
               'SELF_ACCOUNTED', 'RUN_SAMPLED')
_FIELDS = '|'.join(TRAIT_FIELDS)
TRAIT_READ = re.compile(
    # A field of a Traits record or of a registry entry...
    rf"(\btraits|\.traits|_traits\([^)]*\)|traits_lib\.of\([^)]*\)|\bentry"
    rf"|\bdeclared|\bTRAITS"
    rf"|\b[A-Z_]+_TRAITS|\bMIME(_LITE)?)\.({_FIELDS})\b"
    # ... a trait kept as a field of an algorithm, aggregator, compressor
    # or attack ...
    rf"|\b(aggregator|agg|inner|compressor|attack|algorithm|algo|wrapped)"
    rf"\.(checks_update|needs_all_updates|wire_bits|privacy|unbiased|"
    rf"omniscient|unprivatized|indexed_batches)\b"
    # ... a name-keyed table, or an algorithm told by its name.
    rf"|\b({'|'.join(NAME_TABLES)})\b(?!\s*=)|==\s*'dp_fedavg'")
CHECKED = {
    'weighting': r"check_choice\([^)]*'weighting'",
    'skip_nonfinite': r"check_skip_nonfinite\(|check_flag\(",
    'client_metrics': r"check_choice\([^)]*'client_metrics'",
    'local schedule': r"check_schedule\(",
    'optimizers': r"check_optimizer\([^)]*'(client|server|inner|outer|base)_optimizer'",
}
LAYERS = ('algorithms', 'experiments', 'fedjx', 'datasets', 'models')


def code_lines(source: str) -> set[int]:
  """The lines holding code: no blank lines, comments or docstrings."""
  docstrings = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef,
                         ast.AsyncFunctionDef)):
      body = node.body
      if body and isinstance(body[0], ast.Expr) and isinstance(
          body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
        and isinstance(node.value.value, str):  # Attribute docstrings.
      docstrings.update(range(node.lineno, node.end_lineno + 1))
  lines = set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE,
                    tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
      continue
    lines.update(range(tok.start[0], tok.end[0] + 1))
  return lines - docstrings


def exported(tree: ast.Module) -> list[str]:
  for node in tree.body:
    if isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == '__all__' for t in node.targets):
      return [e.value for e in node.value.elts]
  return []


def sources(root: pathlib.Path) -> dict[str, str]:
  out = {}
  for layer in LAYERS:
    for path in sorted((root / layer).rglob('*.py')):
      out[str(path.relative_to(root))] = path.read_text()
  return out


def main(root: pathlib.Path) -> None:
  files = sources(root)
  kit = ast.parse(files['algorithms/kit.py'])
  print(json.dumps({'figure': 'kit_names', 'count': len(exported(kit))}))

  per_module, states = {}, []
  for name, source in files.items():
    if not re.fullmatch(r'algorithms/\w+_lib\.py', name):
      continue
    tree, lines = ast.parse(source), code_lines(source)
    builders = 0
    names = set(exported(tree))
    for node in tree.body:
      if isinstance(node, ast.FunctionDef) and node.name in names and (
          'Algorithm' in ast.unparse(node.returns or ast.Constant(''))):
        builders += len({l for l in lines
                         if node.lineno <= l <= node.end_lineno})
      if isinstance(node, ast.ClassDef) and node.name.endswith('State') and any(
          isinstance(s, ast.AnnAssign) and getattr(s.target, 'id', '') == 'params'
          for s in node.body):
        states.append(node.name)
    per_module[name.split('/')[-1][:-3]] = {'code_lines': len(lines),
                                            'builder_lines': builders}
  print(json.dumps({'figure': 'algorithm_lines', 'modules': per_module,
                    'total_code_lines': sum(m['code_lines'] for m in per_module.values())}))
  print(json.dumps({'figure': 'state_types', 'count': len(states),
                    'names': sorted(states)}))

  reads = {}
  for name, source in files.items():
    if name == 'algorithms/traits.py':
      continue
    lines = source.splitlines()
    for i in sorted(code_lines(source)):
      if TRAIT_READ.search(lines[i - 1]):
        reads[name] = reads.get(name, 0) + 1
  print(json.dumps({'figure': 'trait_reads', 'count': sum(reads.values()),
                    'files': reads}))

  checks = {}
  for option, regex in CHECKED.items():
    checks[option] = sum(len(re.findall(regex, s)) for s in files.values())
  rewriting = sum(len(re.findall(r'\bwith_options\(|\btake_options\(', s))
                  for s in files.values())
  print(json.dumps({'figure': 'option_checks', 'checks': checks,
                    'signature_rewriting_or_taking': rewriting}))
  layering(files)


def imports_in_functions(tree: ast.Module) -> list[ast.stmt]:
  """The import statements inside function bodies, each once."""
  found = {}
  for fn in ast.walk(tree):
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
      for node in ast.walk(fn):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
          found[id(node)] = node
  return sorted(found.values(), key=lambda n: n.lineno)


def layering(files: dict[str, str]) -> None:
  edges = 0
  for name, source in files.items():
    if name.startswith('fedjx/deploy/'):
      for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or '').startswith(
            'fedjx.experiments'):
          edges += 1
        elif isinstance(node, ast.Import):
          edges += sum(a.name.startswith('fedjx.experiments') for a in node.names)
  print(json.dumps({'figure': 'deploy_edges', 'count': edges}))
  reasons = {}
  for name, source in files.items():
    lines = source.splitlines()
    for node in imports_in_functions(ast.parse(source)):
      match = re.search(r'# deferred: (.+)$', lines[node.lineno - 1])
      reason = match.group(1).strip() if match else 'none given'
      for kind in ('optional dependency', 'cycle', 'before JAX'):  # Named in the comment.
        reason = kind if reason.startswith(kind) else reason
      reasons[reason] = reasons.get(reason, 0) + 1
  print(json.dumps({'figure': 'deferred_imports', 'count': sum(reasons.values()),
                    'by_reason': dict(sorted(reasons.items()))}))


if __name__ == '__main__':
  main(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else '.').resolve())
