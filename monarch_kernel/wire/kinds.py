"""Message kinds (the ``k`` field of a header) and every header key used on the wire.

A control message is an envelope frame (header, signature, a small payload) and the
buffer frames (framing and signing: :mod:`.codec`). The header is a
flat dict of plain values (marshal); the payload, when there is one, is a pickle or raw
text. Header keys are one or a few letters on purpose: headers are built and parsed on
the hot path. This module is the reference for them; the tables below list, per
direction and per kind, who sends the message and what each key means.

Peers and sockets
-----------------
The controller binds two ROUTER sockets, ``send`` (controller -> peers) and ``recv``
(peers -> controller); peers connect DEALERs with these routing identities:

* ``h<H>``  host agent of slot ``H`` (its inbox on ``send``, its out socket on ``recv``);
* ``r<R>``  the ordered inbox of the rank of slot ``R`` on ``send`` (also connected to its
  host agent's fan-out ROUTER) and its out socket on ``recv``;
* ``c<R>``  its control socket (served by a side thread) on ``send``;
* ``g<R>``  a throw-away socket it greets its host agent's fan-out ROUTER from.

A slot is a process's wire id: a rank's (host's) flat rank (index) when it was made,
kept while it lives; only a shrink that drops ranks other than the last ones makes a
rank's slot differ from its rank (see ``controller.state.records``).

Keys common to many kinds
-------------------------
=====  ===============  ========================================================================
key    type             meaning
=====  ===============  ========================================================================
``k``  str              the kind (constants below); in every header (the codec drops a header
                        without it)
``b``  list[int]        byte size of each out-of-band buffer frame after the payload; set by
                        ``Codec.encode`` only when there are buffers (at most 1024), checked
                        by ``decode``
``sn`` int              sender nonce: random 64 bits per ``Codec`` instance (per process
                        side; renewed in a forked child). Set by ``Codec.encode`` in every
                        header; with ``sc`` the replay protection (``decode`` drops a
                        repeated or too old counter of a nonce, counted in ``replayed``)
``sc`` int              the sender's message counter (0, 1, 2 ... per ``sn``); set by
                        ``Codec.encode`` in every header
``i``  str | None       request id, unique per controller process. Controller -> rank: set
                        by ``MeshRuntime.request`` (absent from fire-and-forget
                        ``broadcast`` sends). Rank -> controller: the request that a reply,
                        an output chunk or a metric belongs to (None while the rank is idle)
``w``  int (1)          controller -> rank: the sender waits for a reply (set together with
                        ``i`` by ``request``). Without it a rank sends no reply, and a
                        failure goes to the controller as a ``fault``
``r``  int              a rank's *slot* (its wire id: its flat rank when it was made, kept
                        for its life even when a shrink renumbers the ranks; see
                        ``controller.state.records.Slots``): the sender of rank -> controller
                        messages, of a rank's ``hello`` and of replies to peer calls; the
                        rank concerned in ``rank_started`` and ``rank_exit``
``h``  int              the slot of the sending host agent (its index when it was made);
                        host agent -> controller messages only
``d``  list[int]        target ranks' slots: of a fan-out (with ``f``), of one message
                        written to several ranks' lanes (a ``batch``, a gathered call: the
                        same frames for each, answered directly), of ``signal_ranks`` and
                        of ``kill_ranks``
``q``  int | list[int]  per-target sequence number: a rank handles its ordered messages
                        strictly in ``q`` order (later ones are held back while an earlier
                        one is missing), whichever path they came by. With ``d`` a list
                        parallel to it. Counts from 0 again when a rank restarts
``f``  int (1)          fan-out: the host agent forwards the frames (unchanged, still signed)
                        to each of its ranks in ``d``
=====  ===============  ========================================================================

Large values: streams (any direction that carries values)
---------------------------------------------------------
A message whose payload and buffers total more than 4 MiB goes as a stream
(:mod:`.chunks`): a *start*, the message's own header with an empty
payload and no buffers plus the keys below, then its *chunks* (kind ``ck``), in order on
the same connection. The receiver hands the whole message on once the last chunk is in.
Sent by the controller (ordered, control and fanned-out messages), by ranks (results,
replies to peer calls, channel messages) and by peer callers (calls to other ranks).

=====  ===========  ========================================================================
key    type         meaning
=====  ===========  ========================================================================
``z``  list[int]    start: byte size of the payload, then of each buffer (at most 1 + 1024
                    sections, their total at most ``MONARCH_KERNEL_MAX_VALUE``)
``pm`` bytes        start: MAC of the payload (keyed BLAKE2b, ``Codec.payload_mac``)
``st`` int          chunk: the start's ``sc`` (with the sender's ``sn``: the stream)
``x``  int          chunk: the section (0 the payload, 1... the buffers)
``o``  int          chunk: the offset of its one buffer frame (at most 4 MiB) in the section;
                    a fanned-out stream's chunks also carry its ``f`` and ``d``
=====  ===========  ========================================================================

Controller -> host agent (``send`` ROUTER -> ``h<H>``)
------------------------------------------------------
================  =======================================================================
kind              keys
================  =======================================================================
``spawn_ranks``   ``ranks``: list[dict], one per rank to fork on this host, with
                  ``rank`` int (global), ``slot`` int (its wire id, where it is not
                  ``rank``), ``local_rank`` int, ``coords`` list[int] (the
                  rank's point in the mesh), ``host`` int, ``restart_count`` int; on a
                  CURVE mesh ``peer_secret`` str (its TCP peer socket's CURVE secret,
                  the same for every incarnation) and, after its first start,
                  ``peer_port`` int (the port to listen on again if it is free).
                  ``common``: dict shared by those ranks: ``labels`` list[str] and
                  ``sizes`` list[int] (mesh dims), ``world_size`` int, ``local_world_size``
                  int, ``master_addr`` str, ``master_port`` int (torch.distributed
                  rendezvous: rank 0's host), ``run_id`` str, ``mesh`` str (its name),
                  ``env`` dict[str, str] (user ``--env``), ``sys_path`` list[str], ``cwd``
                  str (the controller's import path and working directory), on a
                  CURVE mesh ``listener_key`` str (the secret of the controller's peer
                  keypair: ranks connect to ranks with it, and their TCP listeners
                  admit no other client key). The agent
                  merges each spec over ``common``
                  and adds ``key``, ``send``, ``recv``, ``fanout``, ``hostname`` and
                  ``log`` before it forks the rank.
``signal_ranks``  ``d`` (its ranks to signal), ``sig`` int (signal number, e.g. SIGINT)
``kill_ranks``    ``d``: SIGKILL them; their ``rank_exit`` reports say ``expected``
``stop``          ``grace`` float (seconds, default 3): ask every rank to exit cleanly
                  (SIGTERM: ``atexit`` handlers, finalizers, ``destroy_process_group``),
                  SIGKILL those still running after ``grace``, report their exits, exit
``dump_stacks``   ``d`` (its ranks), ``i`` (the controller's ``stacks`` request): make
                  each rank's main thread dump its own stack with ``faulthandler``
                  (signal-safe: works while the rank is stuck in C code holding the
                  GIL; see ``host.stacks``) and answer
                  each with a ``res`` for ``i`` on the rank's behalf (``h`` set)
``new_port``      ``i`` str: answer with a ``port`` (a free port on this host, for a new
                  torch.distributed rendezvous when a process group is re-formed)
``hb``            (no keys) controller heartbeat; any message resets the agent's silence
                  timer (``hb_timeout`` in its configuration, 10 s by default)
``hello``         (no keys) connection probe, ignored
``detach``        (no keys) a ``--detachable`` mesh's controller leaves without stopping
                  it: the agent keeps its ranks running, sends nothing more, and stops
                  them only when no controller attached within its ``detach_keep``
                  seconds (see :mod:`.desk` for attaching)
(any ordered      with ``f`` = 1, ``d`` (its ranks among the targets) and ``q`` (list);
rank kind)        relayed to the ranks' inboxes, never interpreted by the agent
================  =======================================================================

Host agent -> controller (``h<H>`` -> ``recv`` ROUTER)
------------------------------------------------------
================  =======================================================================
kind              keys
================  =======================================================================
``host_ready``    ``h``; ``pid`` int (agent process); ``host`` str (hostname); ``addr`` str
                  (the address other hosts reach it at: ``advertise`` from its
                  configuration, default 127.0.0.1); ``port`` int (a free port, used as
                  MASTER_PORT when this is host 0); ``desk`` str (a detachable mesh's
                  agent: its attach desk's address, :mod:`.desk`);
                  ``dir`` str (such an agent's private directory: its ranks' logs).
                  Sent once, first
``hb``            ``h``: heartbeat, every 0.5 s
``port``          ``h``, ``i`` (the ``new_port`` request), ``port`` int: a free port
``res``           ``h``, ``i`` (the controller's ``stacks`` request), ``r``, ``ok`` = 1:
                  the answer to ``dump_stacks`` on rank ``r``'s behalf; payload the
                  pickled ``tuple[ThreadStack, ...]`` parsed from faulthandler's dump
``rank_started``  ``h``, ``r``, ``pid`` int: the template forked rank ``r``
``rank_exit``     ``h``, ``r``, ``pid`` int; ``code`` int | None (exit status, None if
                  killed by a signal); ``sig`` int | None (the signal that killed it);
                  ``tail`` list[str] (last lines of the rank's log: what it printed
                  before dying); ``expected`` bool (the exit was asked for: ``kill_ranks``
                  or the agent shutting down)
``fan_in``        ``h``, ``i``: what the agent's ranks sent for fanned-out request ``i``
                  (output chunks and replies; identical bytes of several ranks as one
                  part naming them): payload ``wire.fanin.encode_parts``, a marshal
                  list of ``(kind, ranks, name, ok, data)`` (see ``wire.fanin``)
``taken_over``    ``h``, ``by`` list (``[pid, hostname]`` of the kernel that attached
                  with ``--force``): the receiving controller no longer holds the mesh
================  =======================================================================

``reason`` is never sent: the controller fills it in (str) for ranks it declares dead
itself, when their host is lost (no heartbeat or agent process gone); it then reads the
``rank_exit`` keys above from that synthesized dict, as if a host agent had sent it.

Host agent <-> rank (the agent's fan-out ROUTER)
------------------------------------------------
``hello`` from ``g<R>`` to the agent carries ``r``: "rank R is starting, answer my
inbox". The agent's answer, to identity ``r<R>``, is a ``hello`` with no keys; once it
arrives the rank knows fanned-out messages reach it, and sends ``ready``. Fanned-out
messages are the controller's frames, byte for byte.

Controller -> rank, ordered (``send`` ROUTER -> ``r<R>``, or fanned out; main thread)
-------------------------------------------------------------------------------------
Every one carries ``q`` (see above); ``i`` and ``w`` when a reply is wanted (then the
rank answers with one ``res``). Handled one at a time, in ``q`` order, by
``Rank._dispatch``.

================  =======================================================================
kind              keys and payload
================  =======================================================================
``spawn_actor``   ``a`` str (actor name). Payload: pickled ``(cls, args, kwargs)``.
                  Reply value: None
``call``          ``a`` str (actor name), ``m`` str (endpoint method name), ``sl`` list
                  (only when the call is to a slice: its labels, sizes, strides and
                  offset, for ``context().message_rank``), ``rp`` int (only from a
                  rank to ranks of its machine: its pid; the result's large CUDA tensors
                  come as handles, ``res``'s ``x``). Payload: pickled ``(args,
                  kwargs)``. Reply value: what the endpoint returned (awaited if a
                  coroutine)
``exec``          (no keys) Payload: pickled ``{"code": str, "cell": str, "header":
                  list[str]}`` (the cell's code, its label in tracebacks, the magic lines
                  above the code). Reply value: the cell's last expression, or None
``stop_actor``    ``a`` str: forget that actor. Reply value: None
``debug``         ``x`` int (1: only release the kept failure). Open a post-mortem pdb
                  on the frame where the rank's last cell or endpoint failed (its prompts
                  come as ``input`` with ``dbg``); reply value: True if there was a kept
                  failure (now released), False if there was none
``hello``         (no keys, no ``q``) the controller's connection probe, ignored
``batch``         ``n`` int (how many calls it carries, at least 2). Fire-and-forget
                  ``call`` messages that were queued back to back for the same ranks,
                  sent as one signed message (one ``sc``, one ``q`` per rank; with ``d``
                  a list parallel to it even when not fanned out, so that one encoding
                  goes to every rank). Payload: marshal (format 4) of a list of ``n``
                  ``[header, payload]`` pairs, each a ``call`` header without ``q``,
                  ``i``, ``w``, ``f`` or ``d`` and its pickled ``(args, kwargs)``; parsed
                  only after the signature verified; the rank runs them in list order
``lane``          ``p``, ``wk``, ``bl`` str (``/proc/<pid>/fd/<n>`` paths: the lane's
                  file, the pipe that wakes the rank, the controller's doorbell), ``n``
                  int (data bytes of each ring), ``cp`` int (the controller's pid): a
                  same-machine lane (``wire.lane``), offered once the rank is ready on a
                  mesh on unix sockets. Not answered with a ``res``: the rank maps it
                  and sends ``lane_on``, or ignores it (a detachable mesh's rank)
================  =======================================================================

Rank -> rank, actor calls (caller's DEALER -> the callee's inbox, main thread)
------------------------------------------------------------------------------
A rank holding a mesh reference (an ``ActorMesh`` passed to it) calls the target ranks
directly: ``call``, ``spawn_actor`` and ``stop_actor`` as above, signed with the
*target* mesh's key (carried by the reference), sent to the target rank's inbox, which
also listens for peers (``pa`` of its ``ready``): on a unix socket for callers of its
machine and, in a mesh of a multi-machine backend, on a CURVE TCP socket for others.
No ``q`` (FIFO per caller comes from its connection), ``i`` (a ``p``-prefixed id unique
in the caller) and ``w`` when a reply is wanted, and:

A *peer address* (``pa``, ``rt``, ``oa``) is a list of four str, ``[machine, ipc, tcp,
curve]`` (:class:`~.peer_address.PeerAddress`): the hostname, the
``ipc://`` address (same machine), the ``tcp://`` address or "" and that listener's
CURVE public key (z85) or "".

=====  =====  ==================================================================
key    type   meaning
=====  =====  ==================================================================
``rt`` addr   the caller's reply address (a bound PULL socket): the ``res`` for
              ``i`` goes there (signed with the target's key), not to the
              controller; output still goes to the target's controller
``oa`` addr   ``spawn_actor`` from an actor: the owner's inbox (peer address);
              with ``ox`` str (the owner mesh's key, hex) and ``on`` str (the
              owner actor's name). The new actor's unanswered failures go to
              the owner as ``supervise`` instead of to the controller as ``fault``
=====  =====  ==================================================================

``supervise`` (rank -> its owner's inbox, signed with the owner's key; no ``i``):
``on`` str (the owner actor). Payload: pickled ``{"mesh", "actor", "rank", "report",
"path"}`` (the failed mesh, actor and rank, the failure report, the owners that did
not handle it). The owner's ``__supervise__(MeshFailure)`` runs on its main thread;
unless it returns True the failure goes on to the owner's owner, or to its controller
as a ``fault``.

Controller -> rank control thread (``send`` ROUTER -> ``c<R>``; unordered)
--------------------------------------------------------------------------
Served by ``Rank._control`` while the main thread runs user code. No ``q``.
``push``/``pull``/``ping`` carry ``i`` and ``w`` and get one ``res``; what their
handler raises becomes an error ``res`` (or a ``fault`` without ``i``). Unknown kinds
are ignored.

================  =======================================================================
kind              keys and payload
================  =======================================================================
``push``          Payload: pickled ``{name: value}``, set in the rank's cell namespace.
                  Reply value: the sorted names
``pull``          Payload: pickled ``list[str]`` of names. Reply value: their values, in
                  that order (NameError if one is missing)
``ping``          (no payload) Reply value: ``{"pid": int, "rejected": int, "pg": str |
                  None, "pg_live": bool}``: ``rejected`` counts messages the rank's codec
                  dropped (forged, malformed or replayed); ``pg`` is the backend of the last
                  process group initialised on the rank (kept after an abort), ``pg_live``
                  whether one is initialised now and usable (a re-formable group that
                  was aborted, or has a collective pending while the rank is idle, is
                  not)
``cancel``        ``c`` str: the request id to interrupt (SIGINT in the main thread if
                  it runs user code for it now) or to skip when it comes (then answered
                  with a "cancelled before it started" error if it wants a reply).
                  No reply to the cancel itself
``tensor_stop``   ``s`` int: the stop button stopped the tensor-engine ops numbered up
                  to ``s`` (the ``seq`` of their records): those the rank has not run
                  yet do not run, and hold the interruption until the ``Resume``
                  record sent after them. No reply
``stacks``        ``i``, ``w``. Reply value: ``tuple[ThreadStack, ...]`` (every thread's
                  Python stack now; see ``wire.stacks``)
``attached``      ``i``, ``w`` (a rank of a detachable mesh, from a controller that took
                  it over). Reply value: ``{"history": [(time, request, metrics), ...]
                  (every ``report()`` kept, oldest first), "dropped": int (messages
                  dropped while no controller was connected)}``; then the rank sends the
                  results and faults it kept meanwhile, as it would have
``abort_pg``      ``why`` str (optional: what happened, for the errors of the collectives
                  it cuts short). Abort the rank's torch.distributed process groups, if
                  any: peers blocked in a collective with this rank are released with an
                  error (re-formable groups stay, to be formed again)
``input_reply``   ``n`` int (the ``input`` request answered), and ``v`` str (the line
                  typed) or ``e`` str (why there is none: the rank's ``input()`` raises
                  EOFError with it; a debugger prompt takes ``e`` = ``interrupted`` as
                  KeyboardInterrupt and any other ``e`` as ``detach``)
``train``         ``i``, ``w``. Payload: a pickled ``wire.train_msgs.Order`` for a rank
                  parked at a training step boundary (``reform``, ``offer``, ``load``,
                  ``resume``, ``raise``) or restarted (``expect``). Reply value: per order
``dap_breaks``    ``i``, ``w``. Payload: pickled ``{path: (lines, source)}``, the notebook's
                  visual-debugger breakpoints in its own cells (all of them: replaces the
                  last); while there are some, endpoint calls run with them armed. Reply
                  value: the sorted paths with breakpoints
``mesh_ref``      (no keys) Payload: a pickled ``list[calls.requester.MeshRef]``: meshes of
                  this controller as they are now, sent to every live rank after a mesh
                  was grown or shrunk (and to a rank that starts while one has been):
                  mesh handles the rank holds take on the newest (``calls.mesh_refs``)
``hello``         (no keys) the controller's connection probe, ignored
================  =======================================================================

Rank -> controller (``r<R>`` -> ``recv`` ROUTER; every one carries ``r``)
-------------------------------------------------------------------------
================  =======================================================================
kind              keys and payload
================  =======================================================================
``ready``         ``pid`` int, ``host`` str (hostname), ``dev`` str (``cpu`` or
                  ``cuda:N``), ``rc`` int (its ``restart_count``: a late ``ready`` of an
                  earlier incarnation is ignored), ``pa`` (the peer address its inbox
                  also listens on, for actor calls from other ranks): started, greeted
                  by its host agent, taking work
``res``           ``i`` (the request answered), ``ok`` int: 1 = payload is the pickled
                  value (buffers out of band, sizes in ``b``); 0 = payload is a pickled
                  failure report (a dict: type, message, traceback, line, tensors,
                  where, exception, host; see ``rank.errors.exception_report``);
                  ``x`` = 1 (an answer to a ``call`` with ``rp``): the payload is pickled
                  ``(handles, value)``, the value's large CUDA tensors read through the
                  handles (``rank.dataplane.cuda_results``)
``out``           ``i`` (the request being served, or None), ``n`` str (``stdout`` or
                  ``stderr``). Payload: the text, UTF-8 (not pickled)
``display``       ``i`` (the request being served, or None), ``op`` str (``display``,
                  ``update``, ``clear`` or ``clear_wait``: ``IPython.display``'s
                  ``display``, ``update_display``, ``clear_output(wait=...)``), ``di``
                  (the display id the rank gave, or None). Payload: pickled
                  ``{"data": MIME bundle, "metadata": dict}`` (image bytes raw, not
                  base64), bounded by the rank (``rank.stdio.display.MAX_BYTES``); empty for
                  the clears
``metric``        ``i`` (the request being served, or None). Payload: pickled
                  ``dict[str, float]`` from ``monarch_kernel.report(...)``
``stop_mesh``     (no keys) Payload: pickled ``{"mesh", "key", "grace", "rt", "id"}``:
                  stop process mesh ``mesh`` of this controller (``key``, its key in hex,
                  must match: only a holder of a reference may), then send a ``res``
                  for ``id`` (signed with the sender's mesh key) to ``rt``, the
                  sender's reply socket
``ask``           (no keys) Payload: pickled ``{"op", "rt", "id", ...}``: run operation
                  ``op`` of the actor API in the controller (``get_or_spawn_controller``:
                  ``call``, the pickled ``(name, cls, args, kwargs)``; ``where_is_rank``:
                  ``call``, the pickled ``(mesh, key, rank, wait)``, answered with a
                  ``RankLocation`` once that mesh is no longer restarting) and send its
                  pickled result (or a failure report) as a ``res`` for ``id`` to ``rt``,
                  signed with the sender's mesh key
``owned``         ``a`` str: actor ``a`` of this rank was spawned by an actor of another
                  rank, its owner. Payload: pickled ``{"oa", "ox", "on"}`` (as in
                  ``spawn_actor`` from a rank). If this rank dies, the controller sends
                  the owner a ``supervise`` for it
``peer_actor``    ``a`` str, ``x`` int: another rank (or this one) spawned (``x`` 1) or
                  stopped (``x`` 0) actor ``a`` here with a rank-to-rank message; for a
                  spawn, the payload and buffers are the spawn's (and ``oa``/``ox``/``on``
                  its owner, if an actor spawned it): the controller re-creates the actor
                  when this rank restarts, as it does actors it spawned itself
``fault``         (no ``i``) Payload: pickled failure report of fire-and-forget work
                  (a message without ``w``, or a control handler failing without ``i``)
``input``         ``i`` (the request being served, or None), ``n`` int (serial, per
                  rank), ``p`` str (the prompt), ``pw`` int (1 for ``getpass``: do not
                  echo). The rank's ``input()`` blocks until an ``input_reply``.
                  A debugger prompt (pdb waiting for a command) adds ``dbg`` int (1),
                  ``at`` str (where it is stopped, e.g. ``cell line 7``) and ``pm`` int
                  (1: post-mortem); its payload is what pdb printed since its last prompt
                  (UTF-8, at most 1 MiB)
``resumed``       ``i``, ``n`` int (the debugger's last prompt serial: withdrawn if still
                  asked), ``why`` str (``continue``, ``detach``, ``quit``, ``timeout``,
                  ``interrupted``, ``done``): the rank's debugger lets it run on
``train_notice``  Payload: a pickled ``wire.train_msgs.Notice``: the rank runs steps of a
                  ``TrainingState`` in a request, is parked at a step boundary, or
                  loaded a replica's state
``stats``         Payload: pickled ``{"rss": int, "time": float, "bytes_out": int,
                  "bytes_in": int}`` plus ``"gpu_mem": int`` once CUDA is initialised
                  and ``"pg": str`` (the backend) once a process group was; once a
                  second, from the control thread
``lane_on``       ``r``: the rank opened the lane of its ``lane``; the last message it
                  sends over its socket to the controller, which then reads the lane
                  (everything after comes through it, in order)
================  =======================================================================

Rank <-> rank data plane (not control messages)
-----------------------------------------------
:mod:`monarch_kernel.rank.dataplane.plane` signs its requests with the same codec, with its
own kinds (literals there, not constants here): a request ``k`` = ``"req"`` with ``op``
str (``fetch``, ``shm``, ``write``, ``release``, ``ipc`` or ``ipc_done``), ``id`` int (the
shared tensor's id), ``n`` str (a fresh nonce) and ``t`` float (the sender's time); a
``fetch`` names a range, ``off`` int and ``len`` int (at most 4 MiB: a tensor comes a chunk
per request), a ``write`` its ``off`` and carries the bytes as one buffer frame; a reply
``"data"`` (the range's bytes as one buffer frame), ``"shm"`` with ``path`` str (a
shared-memory file holding them), ``"ok"``, or ``"err"`` with ``error`` str. An ``ipc``
request carries ``p`` int (the reader's pid); its reply ``"ipc"`` has ``lease`` int and
the CUDA IPC description (``rank.dataplane.cuda_ipc.describe``); ``ipc_done`` names the
``lease`` and is one-way (never answered, ``server.ONE_WAY``). Every reply has ``re`` str,
the nonce of the request it answers: the reader drops a reply to another request.

Size: over the ~450-line habit on purpose: it is the one reference of every message kind
and header key, read as a table; split, a reader would look in several places for one
message.
"""

# controller -> host agent
SPAWN_RANKS = "spawn_ranks"
SIGNAL_RANKS = "signal_ranks"
KILL_RANKS = "kill_ranks"
STOP = "stop"  # header "grace": seconds ranks get to exit cleanly
DUMP_STACKS = "dump_stacks"
NEW_PORT = "new_port"
#: A detachable mesh's controller leaves (its kernel shuts down): the agent keeps its
#: ranks running, without a controller, for the mesh's ``keep`` seconds.
DETACH = "detach"
HEARTBEAT = "hb"  # also host agent -> controller (with "h")
#: Connection probe: proves a ROUTER peer is routable before real messages go to it.
HELLO = "hello"
#: A chunk of a large value's stream (any direction; see "Large values" above).
CHUNK = "ck"

# host agent -> controller
HOST_READY = "host_ready"
RANK_STARTED = "rank_started"
RANK_EXIT = "rank_exit"
PORT = "port"
#: The answers of several of the agent's ranks to one fanned-out request, combined
#: (``wire.fanin``): header ``h``, ``i``; payload ``wire.fanin.encode_parts``.
FAN_IN = "fan_in"
#: rank -> its host agent: its reply to request ``i`` went to the controller directly.
FAN_DIRECT = "fan_direct"
#: The latest once-a-second ``stats`` of the agent's ranks, combined: header ``h``;
#: payload a pickled ``{rank: that rank's stats payload}`` (``host.fanin``); with header
#: ``g`` = 1, a pickled pair of that and ``{rank: wire.reports.GpuStats}`` (the GPU each
#: rank is on, sampled by the agent through NVML: ``host.gpu_stats``).
HOST_STATS = "host_stats"
#: The ranks' ``steps`` batches of the last 0.1 s, combined: header ``h``; payload a
#: pickled ``{rank slot: [its steps payloads]}`` (``host.step_fanin``).
HOST_STEPS = "host_steps"
#: To the controller holding a detachable mesh: another one took it over (``%mesh attach
#: --force``); header ``by``: ``[pid, hostname]`` of the new one.
TAKEN_OVER = "taken_over"

#: Sequence numbers (header ``q``) of the ``n``-th controller to hold a detachable mesh
#: start at ``n * SEQ_EPOCH``: a rank that sees a number of a later epoch knows an
#: earlier controller is gone and counts on from there (what that one sent and the rank
#: has not handled yet is dropped).
SEQ_EPOCH = 1 << 40

# controller -> rank (ordered, main thread)
SPAWN_ACTOR = "spawn_actor"
CALL = "call"
#: Several fire-and-forget ``call`` messages in one (see the table above).
BATCH = "batch"
EXEC = "exec"
STOP_ACTOR = "stop_actor"
SUPERVISE = "supervise"  # rank -> owner rank's inbox: a failure of a mesh it owns
OWNED = "owned"  # rank -> controller: actor ``a`` here is owned by an actor elsewhere
PEER_ACTOR = "peer_actor"  # rank -> controller: a rank spawned (stopped) actor ``a`` here
STOP_MESH = "stop_mesh"  # rank -> controller: stop a mesh it holds a reference to
ASK = "ask"  # rank -> controller: an operation of the actor API (get_or_spawn_controller)
DEBUG = "debug"  # post-mortem pdb on the rank's last failure (header "x": only release it)
#: A batch of tensor-engine operations (``monarch_kernel.tensor_engine``): header ``n``
#: (how many); payload a pickled list of ``wire.tensor_ops`` records, run in order on the
#: rank's main thread. Fire and forget, or a request (``i``, ``w``) whose last record is a
#: ``Fetch``: every rank of the mesh answers once it ran everything before it.
TENSOR_OPS = "tensor_ops"
#: A same-machine lane for this rank (``wire.lane``; header ``p``, ``wk``, ``bl``, ``n``,
#: ``cp``: ``wire.headers.Lane``); answered with ``lane_on``.
LANE = "lane"

# controller -> rank control thread (unordered, served while the main thread is busy)
PUSH = "push"
PULL = "pull"
PING = "ping"
CANCEL = "cancel"  # header "c": the request to interrupt (running) or skip (not started)
#: The stop button stopped the tensor-engine ops up to ``s`` (those not run yet do not run).
TENSOR_STOP = "tensor_stop"
STACKS = "stacks"
ABORT_PG = "abort_pg"
#: A controller took a detachable mesh over: reply with the rank's metric history, then
#: send what it kept while no controller was connected (results, faults).
ATTACHED = "attached"
INPUT_REPLY = "input_reply"
#: An order to a rank parked at a training step boundary (``wire.train_msgs.Order``).
TRAIN = "train"
#: The visual debugger's breakpoints in the notebook's own cells (actor endpoints).
DAP_BREAKS = "dap_breaks"
#: A mesh was resized: the new references to it (``calls.mesh_refs``).
MESH_REF = "mesh_ref"
#: ``%mesh profile``: run ``torch.profiler`` for the next steps of the running loop
#: (pickled ``wire.steps``-side ``ProfileOrder``); the reply, once the steps ran, is the
#: rank's trace (``rank.telemetry.profile``).
PROFILE = "profile"

# rank -> controller
READY = "ready"
RESULT = "res"
STREAM = "out"
DISPLAY = "display"  # a rich display (IPython's display(), a matplotlib figure)
METRIC = "metric"
FAULT = "fault"
INPUT = "input"
RESUMED = "resumed"  # the rank's debugger let it run on (header "why")
STATS = "stats"  # once a second from each rank: memory and data-plane byte counters
#: What a rank tells about its training (``wire.train_msgs.Notice``).
TRAIN_NOTICE = "train_notice"
#: A batch of the rank's finished training steps (header ``r``; payload
#: ``wire.steps.encode_steps``): sent through its host agent's fan-in socket where there
#: is one, which passes it on as it is.
STEPS = "steps"
#: The rank opened its lane (header ``r``): the last message it sends over its socket.
LANE_ON = "lane_on"

#: The version of this protocol (the kinds and keys above, and the join handshake). A
#: host agent sends it when it joins (``{"token": ..., "protocol": N}``), the join
#: endpoint answers with its own and refuses a different one, so that machines with
#: another monarch_kernel version fail at once with a clear error, not on a key later.
PROTOCOL_VERSION = 17  # 2: the ``display`` kind; 3: large values travel as streams of chunks;
# 4: the ``train`` and ``train_notice`` kinds (state from peers); 5: ``dap_breaks``;
# 6: fan-in (``fan_in``, ``fan_direct``); 7: ``batch``; 8: ``host_stats``, slots
# (``slot`` in ``spawn_ranks``, ranks named by their slot on the wire) and ``mesh_ref``;
# 9: one envelope frame (length word, header, signature, small payload) instead of
# three frames (``wire.codec``); 10: the package's modules moved into capability
# subpackages (``controller/state``, ``rank/pg`` ...), so pickled class paths changed,
# and ``spawn_ranks``' common part names the ``listener_key`` (was ``peer_key``); 11:
# ``host_stats`` may carry the ranks' GPU stats (header ``g``); 12: step telemetry
# (``steps``, ``host_steps``) and ``profile``; 13: ``tensor_ops`` (the tensor engine);
# 14: signatures (envelopes and streamed payloads) are keyed BLAKE2b-256, not HMAC-SHA256
# 15: ``rp`` in ``call`` and ``x`` in ``res`` (CUDA results by handle); 16: ``lane`` and
# ``lane_on`` (same-machine lanes); 17: ``tensor_stop``
