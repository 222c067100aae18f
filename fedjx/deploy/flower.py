"""fedjx rounds on Flower: a ClientApp and the strategy that drives it.

Flower (SuperLink / SuperNodes, https://flower.ai) carries the messages;
fedjx supplies what they hold. One round ``r`` of an algorithm's deployed
rounds (:class:`fedjx.deploy.rounds.ServerRounds`) maps onto Flower as

=====================  ========================================  ===========
fedjx piece            Flower                                    runs on
=====================  ========================================  ===========
sample the cohort      ``FedjxStrategy.configure_train``         server
``server_prepare``     ``configure_train``: one TRAIN message    server
                       per sampled client (``to_clients`` and
                       its slice of ``placed``)
``client_work``        :func:`client_app`'s ``@train``: program  each node
                       bytes (``fedjx.deploy.programs``) called
                       on the node's own partition
aggregations           ``FedjxStrategy.aggregate_train``         server
``server_update``      ``aggregate_train``                       server
=====================  ========================================  ===========

Failures follow Flower's FedAvg rules: a round's messages go to the nodes
that hold the sampled clients; a node that replies with an error, or not
within ``timeout`` seconds, is left out of the round; the round aggregates
the clients that replied (sums and means over them), and when none did the
state stays as it was. Every round's metrics count them: ``deploy_sampled``,
``deploy_replied``, ``deploy_failed`` (with reasons in the round's detail,
:meth:`FedjxStrategy.record`).

A node is lost when the SuperLink no longer lists it as connected (it
missed its heartbeats) or answers in its place that it is unavailable: the
round goes on with the nodes alive, later rounds neither send to it nor
wait for it (``deploy_nodes_lost`` counts each once), and it is found again
if it reconnects.

Stopping: the strategy's stop file (``stop_file``, e.g. ``workdir/``
:data:`STOP_FILE`; :func:`request_stop` writes it) or SIGTERM/SIGINT to the
ServerApp's process ends :func:`run` at once: the round in flight is dropped
(never recorded short of the clients the stop cut off) and
:meth:`FedjxStrategy.save` keeps the last complete round.

Nodes are found with a QUERY message: each node answers with its node
config's ``partition-id`` and ``num-partitions`` (``flower-supernode
--node-config "partition-id=0 num-partitions=3"``); ``num-partitions`` must
be the population size, and client ``c`` of the population is the node of
``partition-id = c``.

The client program is sent to a node once per program (its SHA-256 in
every message); the node keeps it in its Flower ``Context.state``. The data
a node needs to build its client (the ``node_data`` string the strategy
sends) is read on the node by the function given to :func:`client_app`.

An experiment config's ServerApp and ClientApp (metrics, checkpoints and
resumption in a workdir) are the experiments layer's (``docs/deploy.md``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from logging import INFO, WARNING
from typing import Any

import jax
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
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.serverapp import strategy as flwr_strategy
from flwr.supercore import log

import fedjx
from fedjx.deploy import programs
from fedjx.deploy import rounds

__all__ = ['STOP_FILE', 'FedjxStrategy', 'StopRequested', 'client_app', 'describe',
           'message_bytes', 'request_stop', 'run', 'train']

# Keys of the records in fedjx's messages.
ARRAYS = 'fedjx-arrays'
CONFIG = 'fedjx'
OUTPUTS = 'fedjx-outputs'
METRICS = 'fedjx-metrics'
PROGRAM_STATE = 'fedjx-program'
# A stop file's usual name in a run's directory (see the module).
STOP_FILE = 'deploy.stop'
# Seconds between two looks at the replies (and the nodes) while a round waits.
POLL_S = 0.5


class StopRequested(Exception):
  """A stop was asked for (``STOP_FILE`` or a signal) while a round ran."""


def request_stop(workdir: str) -> str:
  """Asks the ServerApp whose stop file is ``workdir/`` :data:`STOP_FILE` to
  stop after saving its last complete round; returns the stop file's path."""
  path = os.path.join(workdir, STOP_FILE)
  with open(path, 'w', encoding='utf-8') as f:
    f.write('stop\n')
  return path


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

NodeDataFn = Callable[[str, int, int], rounds.NodeData]
"""``(node_data, partition_id, num_partitions) -> NodeData``: a node's client
from the string the strategy sends (``FedjxStrategy(node_data=...)``)."""


def client_app(node_data: NodeDataFn) -> ClientApp:
  """The ClientApp of fedjx rounds: :func:`describe` answers QUERY messages,
  :func:`train` runs ``client_work`` on the client ``node_data`` builds."""
  app = ClientApp()
  app.query()(describe)
  app.train()(functools.partial(train, node_data=node_data))
  return app


def _node_partition(context: Context) -> tuple[int, int]:
  config = context.node_config
  missing = [k for k in ('partition-id', 'num-partitions') if k not in config]
  if missing:
    raise ValueError(
        f'fedjx.deploy.flower: node config lacks {missing}; start the node with '
        '--node-config "partition-id=<c> num-partitions=<clients>".')
  return int(config['partition-id']), int(config['num-partitions'])


def describe(msg: Message, context: Context) -> Message:
  """Says which client this node holds, and which fedjx it runs."""
  partition, num = _node_partition(context)
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


def train(msg: Message, context: Context, node_data: NodeDataFn) -> Message:
  """``client_work`` on this node's own client for the message's round."""
  t0 = time.perf_counter()
  partition, num = _node_partition(context)
  config = msg.content[CONFIG]
  if int(config['client-id']) != partition:
    raise ValueError(f'fedjx.deploy: the server sent work for client '
                     f'{config["client-id"]} to the node of partition-id={partition}.')
  program = _program(config, context)
  data = node_data(str(config['data']), partition, num)
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
  kept here with its structure. Each round's metrics row and detail (the
  sampled, replied, failed and lost clients) go to :meth:`record`, and
  :meth:`save` is called every ``save_every`` rounds, after the last one and
  on a stop; here they keep the rows in :attr:`history` and nothing else
  (the experiments layer's ``RunStrategy`` writes metrics and checkpoints
  to a workdir, and resumes from them).

  Args:
    server: the :class:`~fedjx.deploy.rounds.ServerRounds` of the rounds.
    node_data: the string each TRAIN message carries for the node to build
      its client from (the ``node_data`` function of :func:`client_app`).
    num_rounds: rounds in all (rounds ``start_round`` to ``num_rounds - 1``
      are run).
    evaluate: ``params -> metrics`` on held-out data, or None.
    eval_every: rounds between evaluations (and after the last round).
    save_every: rounds between :meth:`save` calls (0: after the last round only).
    stop_file: a path whose presence asks the rounds to stop ('' for none);
      one left from an earlier run is removed.
    timeout: seconds a round waits for its clients' replies.
    min_available_nodes: nodes to wait for before a round (0: the cohort size).
    wait_s: how long to wait for them before the round goes ahead with the
      nodes that are there.
  """

  def __init__(self, server: rounds.ServerRounds, node_data: str, *,
               num_rounds: int, evaluate: Callable[[Any], Mapping[str, Any]] | None = None,
               eval_every: int = 1, save_every: int = 0, stop_file: str = '',
               timeout: float = 120.0, min_available_nodes: int = 0,
               wait_s: float = 120.0):
    self.server = server
    self.node_data = node_data
    self.num_rounds = int(num_rounds)
    self.evaluate, self.eval_every = evaluate, int(eval_every)
    self.save_every = int(save_every)
    self.stop_file = stop_file
    self.min_available_nodes = min_available_nodes or server.cohort_size
    self.wait_s = wait_s
    self.timeout_s = timeout
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
    self._clear_stop()

  # -- Flower's interface

  def summary(self) -> None:
    log(INFO, '\t├──> fedjx algorithm %r, %d clients, cohort of %d',
        self.server.name, self.server.num_clients, self.server.cohort_size)
    log(INFO, '\t└──> rounds %d to %d', self.start_round, self.num_rounds - 1)

  def configure_train(self, server_round: int, arrays: ArrayRecord,
                      config: ConfigRecord, grid: Grid) -> Iterable[Message]:
    r = self.start_round + server_round - 1
    self.check_stop()
    self._lost_now = []
    self._discover(grid)
    ids, steps = self.server.cohort(r)
    pieces = self.server.pieces(self.state, steps)
    to_clients, placed, residuals = self.server.prepare(pieces, self.state, r)
    data = self.node_data
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
    if self.evaluate is not None and (
        step % self.eval_every == 0 or step == self.num_rounds):
      row.update(self.evaluate(self.state.params))
    self.record(step, row, {
        'round': r, 'sampled': info['ids'], 'replied': replied,
        'failed': {str(c): why for c, why in failed.items()},
        'lost': sorted(self._lost_now),
        'output_shapes': [list(a.shape) for a in pieces.split.client_work.out_avals],
        'received_norms': {str(c): v for c, v in norms.items()},
        **{k: v for k, v in row.items() if k.startswith('deploy_')}})
    self.step = step
    if (self.save_every and step % self.save_every == 0) or step == self.num_rounds:
      self.save()
    metric_record = MetricRecord({k: float(v) for k, v in row.items()
                                  if isinstance(v, (int, float))})
    return ArrayRecord(_arrays(_leaves(self.state), 'state-')), metric_record

  def configure_evaluate(self, server_round: int, arrays: ArrayRecord,
                         config: ConfigRecord, grid: Grid) -> Iterable[Message]:
    return []  # The server evaluates on held-out data (`evaluate`).

  def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                         ) -> MetricRecord | None:
    return None

  # -- fedjx's side

  def save(self) -> None:
    """Keeps the last complete round (``self.step``, ``self.state``); here,
    nothing (a subclass saves a checkpoint)."""

  def record(self, step: int, row: dict[str, Any], detail: dict[str, Any] | None
             ) -> None:
    """Round ``step``'s metrics ``row`` and ``detail`` (the clients sampled,
    replied, failed, lost; None for the evaluation before round 1): appended
    to :attr:`history`."""
    del detail
    self.history.append({'round': step, **row})

  def close(self) -> None:
    """Called once the rounds end (a subclass closes its files)."""

  def on_stop(self) -> None:
    """A stop was requested: the last complete round is saved, the request
    removed, and :attr:`stopped` set."""
    self.save()
    self._clear_stop()
    self.stopped = True
    log(WARNING, 'fedjx: stopped after round %d, the last complete one.', self.step)

  def stop_requested(self) -> bool:
    """Whether a signal or the stop file asks the rounds to stop."""
    return self.signalled or bool(self.stop_file and os.path.exists(self.stop_file))

  def check_stop(self) -> None:
    """Raises :class:`StopRequested` when a stop was asked for."""
    if self.stop_requested():
      raise StopRequested(f'stop requested after round {self.step}')

  def _clear_stop(self) -> None:
    """Removes a stop request (one left from an earlier run, or honoured)."""
    if self.stop_file:
      try:
        os.remove(self.stop_file)
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
    if self.start_round == 0 and self.evaluate is not None:
      self.record(0, dict(self.evaluate(self.state.params)), None)

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
            f'population has {self.server.num_clients} clients; '
            f'start every node with num-partitions={self.server.num_clients} (or '
            f'give the dataset {num} clients).')
      if client in self.nodes and self.nodes[client] != node:
        log(WARNING, 'fedjx: nodes %d and %d both hold partition-id=%d; %d is used.',
            self.nodes[client], node, client, self.nodes[client])
        continue
      self.nodes[client] = node
      if self.lost.pop(client, None) is not None:
        log(INFO, 'fedjx: client %d is back, on node %d.', client, node)

def _leaves(tree: Any) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def run(grid: Grid, strategy: FedjxStrategy, timeout: float) -> FedjxStrategy:
  """Runs the strategy's rounds (``start_round`` to ``num_rounds - 1``) over
  the grid's nodes, each waiting ``timeout`` seconds for its clients. While
  they run, SIGTERM and SIGINT (in the main thread) and the stop file ask
  the rounds to stop: the round in flight is dropped and
  :meth:`FedjxStrategy.on_stop` keeps the last complete one. Returns the
  strategy (its ``state``, ``step`` and ``history``)."""
  try:
    with _signals_stop(strategy):
      strategy.first_rows()
      remaining = strategy.num_rounds - strategy.start_round
      if remaining > 0:
        strategy.start(_WatchedGrid(grid, strategy),
                       ArrayRecord(_arrays(_leaves(strategy.state), 'state-')),
                       num_rounds=remaining, timeout=timeout)
  except StopRequested:
    strategy.on_stop()
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
  return getattr(error, 'code', None) == ErrorCode.NODE_UNAVAILABLE
