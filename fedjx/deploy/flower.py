"""fedjx rounds on Flower: a ServerApp, a ClientApp and the strategy between them.

Flower (SuperLink / SuperNodes, https://flower.ai) carries the messages;
fedjx supplies what they hold. One round ``r`` of a config's experiment
(see :mod:`fedjx.deploy.rounds`) maps onto Flower as

=====================  ========================================  ===========
fedjx piece            Flower                                    runs on
=====================  ========================================  ===========
sample the cohort      ``FedjxStrategy.configure_train``         server
``server_prepare``     ``configure_train``: one TRAIN message    server
                       per sampled client (``to_clients`` and
                       its slice of ``placed``)
``client_work``        ``client_app``'s ``@train``: program      each node
                       bytes (``fedjx.deploy.programs``) called
                       on the node's own partition
aggregations           ``FedjxStrategy.aggregate_train``         server
``server_update``      ``aggregate_train``                       server
metrics, checkpoints   ``aggregate_train`` (``fedjx-run``'s      server
                       writers)
=====================  ========================================  ===========

Failures follow Flower's FedAvg rules: a round's messages go to the nodes
that hold the sampled clients; a node that replies with an error, or not
within ``timeout`` seconds, is left out of the round; the round aggregates
the clients that replied (sums and means over them), and when none did the
state stays as it was. Every round's metrics count them: ``deploy_sampled``,
``deploy_replied``, ``deploy_failed`` (with reasons in
``workdir/deploy.jsonl``).

A node is lost when the SuperLink no longer lists it as connected (it
missed its heartbeats) or answers in its place that it is unavailable: the
round goes on with the nodes alive, later rounds neither send to it nor
wait for it (``deploy_nodes_lost`` counts each once), and it is found again
if it reconnects.

Stopping: a file ``workdir/deploy.stop`` (:data:`STOP_FILE`; the launcher
``fedjx-deploy`` writes it on SIGTERM or Ctrl-C) or SIGTERM/SIGINT to the
ServerApp's process ends the run at once: the round in flight is dropped
(never recorded short of the clients the stop cut off) and a checkpoint of
the last complete round is saved, from which the same run resumes.

Nodes are found with a QUERY message: each node answers with its node
config's ``partition-id`` and ``num-partitions`` (``flower-supernode
--node-config "partition-id=0 num-partitions=3"``); ``num-partitions`` must
be the population size, and client ``c`` of the population is the node of
``partition-id = c``.

The client program is sent to a node once per program (its SHA-256 in
every message); the node keeps it in its Flower ``Context.state``.

Run config (``[tool.flwr.app.config]``, or ``flwr run --run-config``):
``config`` (a fedjx config file, ``path[:arg]``), ``overrides`` (``"a.b=v
c=w"``, values as Python literals), ``workdir``, ``timeout`` (seconds per
round), ``wait-s`` (seconds to wait for nodes), ``min-available-nodes``
(0: the cohort size).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from logging import INFO, WARNING
from typing import Any

import numpy as np

from flwr.app import Array
from flwr.app import ArrayRecord
from flwr.app import ConfigRecord
from flwr.app import Context
from flwr.app import Message
from flwr.app import MessageType
from flwr.app import MetricRecord
from flwr.app import RecordDict
from flwr.clientapp import ClientApp
from flwr.common import serde
from flwr.serverapp import Grid
from flwr.serverapp import ServerApp
from flwr.serverapp import strategy as flwr_strategy
from flwr.supercore import log

from fedjx.deploy import flower_app
from fedjx.deploy import programs
from fedjx.deploy import rounds

__all__ = ['STOP_FILE', 'FedjxStrategy', 'Settings', 'StopRequested', 'client_app',
           'load_config', 'message_bytes', 'request_stop', 'run_server',
           'server_app', 'write_app']

# Keys of the records in fedjx's messages.
ARRAYS = 'fedjx-arrays'
CONFIG = 'fedjx'
OUTPUTS = 'fedjx-outputs'
METRICS = 'fedjx-metrics'
PROGRAM_STATE = 'fedjx-program'
# In the workdir: its presence asks the ServerApp to stop (see the module).
STOP_FILE = 'deploy.stop'
# Seconds between two looks at the replies (and the nodes) while a round waits.
POLL_S = 0.5


class StopRequested(Exception):
  """A stop was asked for (``STOP_FILE`` or a signal) while a round ran."""


def request_stop(workdir: str) -> str:
  """Asks the ServerApp running in ``workdir`` to stop after saving a
  checkpoint of its last complete round; returns the stop file's path."""
  path = os.path.join(workdir, STOP_FILE)
  with open(path, 'w', encoding='utf-8') as f:
    f.write('stop\n')
  return path


# ------------------------------------------------------------------ settings

@dataclasses.dataclass(frozen=True)
class Settings:
  """The ServerApp's run config (see the module docstring)."""

  config: str
  overrides: str = ''
  workdir: str = ''
  timeout: float = 120.0
  wait_s: float = 120.0
  min_available_nodes: int = 0

  @classmethod
  def from_run_config(cls, run_config: Mapping[str, Any]) -> 'Settings':
    known = flower_app.RUN_CONFIG_DEFAULTS
    unknown = sorted(set(run_config) - set(known))
    if unknown:
      raise ValueError(f'fedjx.deploy.flower: run config keys {unknown} are '
                       f'unknown; the keys are {sorted(known)}.')
    values = {k: type(v)(run_config.get(k, v)) for k, v in known.items()}
    if not values['config']:
      raise ValueError("fedjx.deploy.flower: run config 'config' is empty; give "
                       'a fedjx config file (e.g. config="/abs/configs/fedavg_digits.py").')
    return cls(values['config'], values['overrides'], values['workdir'],
               values['timeout'], values['wait-s'], values['min-available-nodes'])


load_config = rounds.load_config


# ------------------------------------------------------------------ wire

def message_bytes(content: RecordDict) -> int:
  """Bytes of a message's content as Flower encodes it (protobuf
  ``RecordDict``; transport framing not counted)."""
  return serde.recorddict_to_proto(content).ByteSize()


def _arrays(values: Sequence[np.ndarray], prefix: str) -> dict[str, Array]:
  return {f'{prefix}{i}': Array(np.ascontiguousarray(v)) for i, v in enumerate(values)}


def _take(record: ArrayRecord, prefix: str) -> list[np.ndarray]:
  keys = sorted((k for k in record if k.startswith(prefix)),
                key=lambda k: int(k[len(prefix):]))
  return [record[k].numpy() for k in keys]


# ------------------------------------------------------------------ client

client_app = ClientApp()


def _node_partition(context: Context) -> tuple[int, int]:
  config = context.node_config
  missing = [k for k in ('partition-id', 'num-partitions') if k not in config]
  if missing:
    raise ValueError(
        f'fedjx.deploy.flower: node config lacks {missing}; start the node with '
        '--node-config "partition-id=<c> num-partitions=<clients>".')
  return int(config['partition-id']), int(config['num-partitions'])


@client_app.query()
def describe(msg: Message, context: Context) -> Message:
  """Says which client this node holds, and which fedjx it runs."""
  partition, num = _node_partition(context)
  import fedjx  # pylint: disable=g-import-not-at-top
  return Message(RecordDict({CONFIG: ConfigRecord({
      'partition-id': partition, 'num-partitions': num,
      'fedjx': fedjx.__version__, 'format': programs.FORMAT_VERSION})}),
                 reply_to=msg)


def _program(config: ConfigRecord, context: Context) -> programs.Program:
  """The round's client program: sent with the message, or kept from before."""
  digest = str(config['program-sha256'])
  if 'program' in config:
    data = bytes(config['program'])
    program = programs.unpack(data)  # Refuses other versions, in one line.
    context.state[PROGRAM_STATE] = ConfigRecord({'sha256': digest, 'bytes': data})
    return program
  kept = context.state.config_records.get(PROGRAM_STATE)
  if kept is None or kept['sha256'] != digest:
    raise LookupError(f'fedjx.deploy: this node does not hold program '
                      f'{digest[:12]}...; the server must send it again.')
  return programs.unpack(bytes(kept['bytes']))


@client_app.train()
def train(msg: Message, context: Context) -> Message:
  """``client_work`` on this node's own client for the message's round."""
  t0 = time.perf_counter()
  partition, num = _node_partition(context)
  config = msg.content[CONFIG]
  if int(config['client-id']) != partition:
    raise ValueError(f'fedjx.deploy: the server sent work for client '
                     f'{config["client-id"]} to the node of partition-id={partition}.')
  program = _program(config, context)
  data = rounds.NodeData(rounds.DataSpec.from_json(str(config['data'])),
                         partition, num)
  arrays = msg.content[ARRAYS]
  outputs = rounds.run_client(program, _take(arrays, 'to-'), _take(arrays, 'placed-'),
                              data.inputs(int(config['round']), int(config['steps'])))
  return Message(RecordDict({
      OUTPUTS: ArrayRecord(_arrays(outputs, 'out-')),
      CONFIG: ConfigRecord({'program-sha256': program.digest,
                            'partition-id': partition}),
      METRICS: MetricRecord({'client-seconds': time.perf_counter() - t0}),
  }), reply_to=msg)


# ------------------------------------------------------------------ server

class FedjxStrategy(flwr_strategy.Strategy):
  """A fedjx algorithm's round as a Flower strategy.

  ``arrays`` between rounds are the algorithm state's flat leaves (the
  ``ArrayRecord`` that ``Strategy.start`` passes on); the state itself is
  kept here with its structure.

  Args:
    server: the experiment's :class:`~fedjx.deploy.rounds.ServerRounds`.
    workdir: where metrics (``fedjx-run``'s writers), checkpoints and
      ``deploy.jsonl`` go; empty for none.
    timeout: seconds a round waits for its clients' replies.
    min_available_nodes: nodes to wait for before a round (0: the cohort size).
    wait_s: how long to wait for them before the round goes ahead with the
      nodes that are there.
  """

  def __init__(self, server: rounds.ServerRounds, workdir: str = '', *,
               timeout: float = 120.0, min_available_nodes: int = 0,
               wait_s: float = 120.0):
    from fedjx.experiments import checkpointing  # pylint: disable=g-import-not-at-top
    from fedjx.experiments import metrics_writers  # pylint: disable=g-import-not-at-top
    self.server = server
    self.config = server.config
    self.min_available_nodes = min_available_nodes or self.config.cohort_size
    self.wait_s = wait_s
    self.timeout_s = timeout
    self.workdir = workdir
    self.nodes: dict[int, int] = {}          # client id -> node id
    self.lost: dict[int, int] = {}           # client id -> node id, lost once
    self._lost_now: list[int] = []           # clients whose node was lost this round
    self.has_program: dict[int, str] = {}    # node id -> program digest held
    self.state = server.initial_state()
    self.start_round = 0
    self.step = 0  # The last complete round (as a step: rounds done).
    self.signalled = False  # SIGTERM or SIGINT reached the ServerApp.
    self.history: list[dict[str, Any]] = []
    self.stopped = False
    self._round: dict[str, Any] = {}
    self._writer = self._ckpt = None
    if workdir:
      os.makedirs(workdir, exist_ok=True)
      self._ckpt = checkpointing.Checkpointer(os.path.join(workdir, 'checkpoints'),
                                              async_save=False)
      restored = self._ckpt.restore_latest_intact(
          self.state, self._check_same_experiment,
          warn=lambda msg: log(WARNING, 'fedjx: %s', msg))
      step = None
      if restored is not None:
        self.state, meta = restored
        step = self.start_round = self.step = int(meta['step'])
        log(INFO, 'fedjx: resuming %s from the checkpoint after round %d.',
            workdir, step)
      # Rows of rounds after the checkpoint (all, without one) are redone.
      self._truncate_details(step or 0)
      self._clear_stop()
      self._writer = metrics_writers.make_writer(
          workdir, self.config.metrics_format, self.config.tensorboard,
          resume_round=self.start_round if step is not None else None)
      metrics_writers.write_atomically(
          os.path.join(workdir, 'config.json'),
          self.config.to_json_best_effort(indent=2, sort_keys=True) + '\n')

  # -- Flower's interface

  def summary(self) -> None:
    log(INFO, '\t├──> fedjx algorithm %r, %d clients, cohort of %d',
        self.config.algorithm.name, self.server.num_clients, self.config.cohort_size)
    log(INFO, '\t└──> rounds %d to %d', self.start_round, self.config.rounds - 1)

  def configure_train(self, server_round: int, arrays: ArrayRecord,
                      config: ConfigRecord, grid: Grid) -> Iterable[Message]:
    r = self.start_round + server_round - 1
    self.check_stop()
    self._lost_now = []
    self._discover(grid)
    ids, steps = self.server.cohort(r)
    pieces = self.server.pieces(self.state, steps)
    to_clients, placed, residuals = self.server.prepare(pieces, self.state, r)
    data = self.server.spec.to_json()
    messages, clients, missing, sent = [], [], [], 0
    for position, client in enumerate(ids.tolist()):
      node = self.nodes.get(client)
      if node is None:
        missing.append(client)
        continue
      record = ConfigRecord({
          'round': r, 'client-id': client, 'steps': steps, 'data': data,
          'program-sha256': pieces.digest})
      if self.has_program.get(node) != pieces.digest:
        record['program'] = pieces.client_program
      content = RecordDict({
          ARRAYS: ArrayRecord({**_arrays(to_clients, 'to-'),
                               **_arrays([x[position] for x in placed], 'placed-')}),
          CONFIG: record})
      sent += message_bytes(content)
      messages.append(Message(content=content, message_type=MessageType.TRAIN,
                              dst_node_id=node, group_id=str(r)))
      clients.append(client)
    self._round = {'round': r, 'ids': ids.tolist(), 'pieces': pieces,
                   'sent': list(zip(messages, clients)),
                   'residuals': residuals, 'missing': missing, 'sent_bytes': sent,
                   'program_bytes': len(pieces.client_program),
                   'programs_sent': sum('program' in m.content[CONFIG] for m in messages),
                   'model_bytes': int(sum(np.asarray(x).nbytes for x in
                                          _leaves(self.state.params))),
                   't0': time.perf_counter()}
    log(INFO, 'fedjx round %d: client work for %d of %d sampled clients%s', r,
        len(messages), len(ids), f' (no node holds {missing})' if missing else '')
    return messages

  def aggregate_train(self, server_round: int, replies: Iterable[Message]
                      ) -> tuple[ArrayRecord | None, MetricRecord | None]:
    info = self._round
    r, pieces = info['round'], info['pieces']
    by_client: dict[int, list[np.ndarray]] = {}
    failed = {c: 'no node holds this partition' for c in info['missing']}
    received, norms = 0, {}
    # A reply names the message it answers (the SuperLink's own error
    # replies, for a node that stopped, come from the SuperLink, not the node).
    by_message = {m.metadata.message_id: (c, m.metadata.dst_node_id)
                  for m, c in info['sent'] if m.metadata.message_id}
    by_node = {m.metadata.dst_node_id: (c, m.metadata.dst_node_id)
               for m, c in info['sent']}
    for msg in replies:
      client, node = (by_message.get(msg.metadata.reply_to_message_id)
                      or by_node.get(msg.metadata.src_node_id) or (None, None))
      if client is None:
        continue  # Not an answer to this round's messages.
      if msg.has_error():
        failed[client] = f'error: {msg.error.reason}'
        self.has_program.pop(node, None)
        if _unavailable(msg.error):
          self._lose(client, node, 'the SuperLink reports it unavailable')
        continue
      received += message_bytes(msg.content)
      outputs = _take(msg.content[OUTPUTS], 'out-')
      if len(outputs) != len(pieces.split.client_work.out_avals):
        failed[client] = f'{len(outputs)} outputs, not {len(pieces.split.client_work.out_avals)}'
        continue
      self.has_program[node] = str(msg.content[CONFIG]['program-sha256'])
      by_client[client] = outputs
      norms[client] = [float(np.linalg.norm(np.asarray(o, np.float64).ravel()))
                       for o in outputs]
    for client in info['ids']:
      if client not in by_client and client not in failed:
        failed[client] = ('node lost' if client in self.lost
                          else f'no reply within {self.timeout_s:g} s')
        self.has_program.pop(self.nodes.get(client), None)
    replied = [c for c in info['ids'] if c in by_client]
    row: dict[str, Any] = {}
    if replied:
      self.state, metrics = self.server.update(
          pieces, info['residuals'], [by_client[c] for c in replied])
      row.update(rounds.scalars(metrics))
    else:
      log(WARNING, 'fedjx round %d: no client replied; the state is unchanged.', r)
    row.update({
        'deploy_sampled': len(info['ids']), 'deploy_replied': len(replied),
        'deploy_failed': len(failed),
        'deploy_nodes': len(self.nodes), 'deploy_nodes_lost': len(self._lost_now),
        'deploy_bytes_to_clients': info['sent_bytes'],
        'deploy_bytes_from_clients': received,
        'deploy_program_bytes': info['program_bytes'],
        'deploy_programs_sent': info['programs_sent'],
        'deploy_model_bytes': info['model_bytes'],
        'deploy_round_s': time.perf_counter() - info['t0']})
    step = r + 1
    if self.server.exp.evaluate is not None and (
        step % self.config.eval_every == 0 or step == self.config.rounds):
      row.update(self.server.exp.evaluate(self.state.params))
    self._emit(step, row, {
        'round': r, 'sampled': info['ids'], 'replied': replied,
        'failed': {str(c): why for c, why in failed.items()},
        'lost': sorted(self._lost_now),
        'output_shapes': [list(a.shape) for a in pieces.split.client_work.out_avals],
        'received_norms': {str(c): v for c, v in norms.items()},
        **{k: v for k, v in row.items() if k.startswith('deploy_')}})
    self.step = step
    if step % self.config.checkpoint_every == 0 or step == self.config.rounds:
      self.save()
    metric_record = MetricRecord({k: float(v) for k, v in row.items()
                                  if isinstance(v, (int, float))})
    return ArrayRecord(_arrays(_leaves(self.state), 'state-')), metric_record

  def configure_evaluate(self, server_round: int, arrays: ArrayRecord,
                         config: ConfigRecord, grid: Grid) -> Iterable[Message]:
    return []  # The server evaluates on held-out data (config.eval_*).

  def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                         ) -> MetricRecord | None:
    return None

  # -- fedjx's side

  def save(self) -> None:
    """A checkpoint of the last complete round (``self.step``), if there is
    a workdir and that round is not the one checkpointed at the start."""
    if self._ckpt is None or (self.step == self.start_round
                              and self._ckpt.latest_step() == self.step):
      return
    self._ckpt.save(self.step, self.state, {
        'step': self.step, 'next_round': self.step, 'seed': self.config.seed,
        'config': _fingerprint(self.config)})
    self._ckpt.wait()

  def stop_requested(self) -> bool:
    """Whether a signal or ``workdir/deploy.stop`` asks the run to stop."""
    return self.signalled or bool(
        self.workdir and os.path.exists(os.path.join(self.workdir, STOP_FILE)))

  def check_stop(self) -> None:
    """Raises :class:`StopRequested` when a stop was asked for."""
    if self.stop_requested():
      raise StopRequested(f'stop requested after round {self.step}')

  def _clear_stop(self) -> None:
    """Removes a stop request (one left from an earlier run, or honoured)."""
    if self.workdir:
      try:
        os.remove(os.path.join(self.workdir, STOP_FILE))
      except FileNotFoundError:
        pass

  def wait_replies(self, grid: Grid, messages: Iterable[Message],
                   timeout: float | None) -> list[Message]:
    """Sends ``messages`` and collects their replies until every one
    replied, ``timeout`` seconds passed, or the nodes still owing one are
    no longer connected (lost: not waited for). Raises
    :class:`StopRequested` when a stop is asked for meanwhile."""
    messages = list(messages)
    if not messages:
      return []
    ids = list(grid.push_messages(messages))
    node_of = dict(zip(ids, (m.metadata.dst_node_id for m in messages)))
    pending, replies = {i for i in ids if i is not None}, []
    deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
    while pending:
      got = list(grid.pull_messages(pending))
      replies += got
      pending -= {m.metadata.reply_to_message_id for m in got}
      if not pending or time.monotonic() > deadline:
        break
      self.check_stop()
      alive = set(grid.get_node_ids())
      for mid in [m for m in pending if node_of[m] not in alive]:
        pending.discard(mid)
        client = next((c for c, n in self.nodes.items() if n == node_of[mid]), None)
        if client is not None:
          self._lose(client, node_of[mid], 'it is no longer connected')
      if pending:
        time.sleep(POLL_S)
    return replies

  def _lose(self, client: int, node: int, why: str) -> None:
    """Client ``client``'s node is gone: said once, not waited for again."""
    if client in self.lost:
      return
    self.lost[client] = node
    self._lost_now.append(client)
    self.nodes.pop(client, None)
    log(WARNING, 'fedjx: node %d (client %d) is lost: %s; the rounds go on '
        'with the %d nodes alive.', node, client, why, len(self.nodes))

  def first_rows(self) -> None:
    """The evaluation at step 0, as ``fedjx-run`` writes it."""
    if self.start_round == 0 and self.server.exp.evaluate is not None:
      self._emit(0, self.server.exp.evaluate(self.state.params), None)

  def _check_same_experiment(self, meta: Mapping[str, Any]) -> None:
    """Refuses to resume a workdir whose checkpoint is of another experiment
    (fields that may change on resumption, as ``rounds``, left out)."""
    from fedjx.experiments import config as config_schema  # pylint: disable=g-import-not-at-top
    saved = meta.get('config')
    if not saved:
      return
    a, b = config_schema.flatten(saved), config_schema.flatten(_fingerprint(self.config))
    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if diff:
      details = ', '.join(f'{k}: {a.get(k)!r} -> {b.get(k)!r}' for k in diff[:8])
      raise ValueError(f'fedjx.deploy: {self.workdir} holds a checkpoint of a '
                       f'different experiment ({details}); use a new workdir.')

  def _truncate_details(self, step: int) -> None:
    """Drops ``deploy.jsonl``'s rounds after ``step`` (an interrupted run's)."""
    from fedjx.experiments import metrics_writers  # pylint: disable=g-import-not-at-top
    path = os.path.join(self.workdir, 'deploy.jsonl')
    if os.path.exists(path):
      with open(path, encoding='utf-8') as f:
        kept = [line for line in f if line.strip()
                and json.loads(line)['round'] < step]
      metrics_writers.write_atomically(path, ''.join(kept))

  def _emit(self, step: int, row: dict[str, Any], detail: dict[str, Any] | None) -> None:
    self.history.append({'round': step, **row})
    if self._writer is not None:
      self._writer.write(step, row)
      self._writer.flush()
      if detail is not None:
        with open(os.path.join(self.workdir, 'deploy.jsonl'), 'a', encoding='utf-8') as f:
          f.write(json.dumps(detail, sort_keys=True) + '\n')

  def _discover(self, grid: Grid) -> None:
    """Finds which client each connected node holds (QUERY messages to the
    nodes not seen before), waiting up to ``wait_s`` for
    ``min_available_nodes`` of them."""
    deadline = time.monotonic() + self.wait_s
    while True:
      present = set(grid.get_node_ids())
      for client, node in list(self.nodes.items()):
        if node not in present:
          self._lose(client, node, 'it is no longer connected')
      # Nodes lost once are not waited for: the rounds go on without them.
      wanted = self.min_available_nodes - len(self.lost)
      if len(present) >= wanted or time.monotonic() > deadline:
        break
      log(INFO, 'fedjx: waiting for nodes: %d connected, %d wanted.', len(present),
          wanted)
      self.check_stop()
      time.sleep(1.0)
    new = sorted(present - set(self.nodes.values()))
    if not new:
      return
    queries = [Message(RecordDict({CONFIG: ConfigRecord({'want': 'partition'})}),
                       message_type=MessageType.QUERY, dst_node_id=n, group_id='describe')
               for n in new]
    for reply in self.wait_replies(grid, queries, self.timeout_s):
      node = reply.metadata.src_node_id
      if reply.has_error():
        log(WARNING, 'fedjx: node %d did not describe itself: %s', node,
            reply.error.reason)
        continue
      info = reply.content[CONFIG]
      client, num = int(info['partition-id']), int(info['num-partitions'])
      if num != self.server.num_clients:
        raise ValueError(
            f'fedjx.deploy: node {node} has num-partitions={num}, but the '
            f'population of config.dataset has {self.server.num_clients} clients; '
            f'start every node with num-partitions={self.server.num_clients} (or '
            f'give the dataset {num} clients).')
      if client in self.nodes and self.nodes[client] != node:
        log(WARNING, 'fedjx: nodes %d and %d both hold partition-id=%d; %d is used.',
            self.nodes[client], node, client, self.nodes[client])
        continue
      self.nodes[client] = node
      if self.lost.pop(client, None) is not None:
        log(INFO, 'fedjx: client %d is back, on node %d.', client, node)

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
    if self._ckpt is not None:
      self._ckpt.close()


def _fingerprint(config: Any) -> dict[str, Any]:
  from fedjx.experiments import config as config_schema  # pylint: disable=g-import-not-at-top
  return json.loads(json.dumps(config_schema.fingerprint(config)))


def _leaves(tree: Any) -> list[np.ndarray]:
  import jax  # pylint: disable=g-import-not-at-top
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def run_server(grid: Grid, settings: Settings) -> FedjxStrategy:
  """Runs ``settings.config``'s rounds over the grid's nodes; returns the
  strategy (its ``state`` and ``history``)."""
  config = load_config(settings.config, settings.overrides)
  strategy = FedjxStrategy(rounds.ServerRounds(config), settings.workdir,
                           timeout=settings.timeout,
                           min_available_nodes=settings.min_available_nodes,
                           wait_s=settings.wait_s)
  try:
    with _signals_stop(strategy):
      strategy.first_rows()
      remaining = config.rounds - strategy.start_round
      if remaining > 0:
        strategy.start(_WatchedGrid(grid, strategy),
                       ArrayRecord(_arrays(_leaves(strategy.state), 'state-')),
                       num_rounds=remaining, timeout=settings.timeout)
  except StopRequested:
    strategy.save()
    strategy._clear_stop()  # pylint: disable=protected-access
    strategy.stopped = True
    log(WARNING, 'fedjx: stopped; %s holds the checkpoint after round %d (the '
        'last complete one): the same run resumes from it.',
        settings.workdir or 'no workdir', strategy.step)
  finally:
    strategy.close()
  return strategy


class _WatchedGrid:
  """The grid as ``Strategy.start`` sees it: replies are collected by
  :meth:`FedjxStrategy.wait_replies` (lost nodes and stop requests seen
  while a round waits); everything else is the grid's."""

  def __init__(self, grid: Grid, strategy: FedjxStrategy):
    self._grid, self._strategy = grid, strategy

  def send_and_receive(self, messages: Iterable[Message], *,
                       timeout: float | None = None) -> list[Message]:
    return self._strategy.wait_replies(self._grid, messages, timeout)

  def __getattr__(self, name: str) -> Any:
    return getattr(self._grid, name)


@contextlib.contextmanager
def _signals_stop(strategy: FedjxStrategy):
  """While the rounds run, SIGTERM and SIGINT ask the strategy to stop (it
  saves the last complete round) instead of ending the process mid-round."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return

  def handle(signum, frame):
    del frame
    strategy.signalled = True
    log(WARNING, 'fedjx: %s received; stopping after saving the last complete '
        'round.', signal.Signals(signum).name)

  saved = {s: signal.signal(s, handle) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    yield
  finally:
    for s, h in saved.items():
      signal.signal(s, h)


def _unavailable(error: Any) -> bool:
  """Whether a reply's error is the SuperLink's own: the node is offline."""
  from flwr.common.constant import ErrorCode  # pylint: disable=g-import-not-at-top
  return getattr(error, 'code', None) == ErrorCode.NODE_UNAVAILABLE


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
  """The ServerApp: a fedjx config's rounds (run config: see the module)."""
  # absl (imported by fedjx) gives the root logger a handler; Flower's logger
  # has its own, so its lines would print twice.
  logging.getLogger('flwr').propagate = False
  run_server(grid, Settings.from_run_config(context.run_config))


# ------------------------------------------------------------------ app

write_app = flower_app.write_app
