"""Message kinds (the ``k`` field of a header) and the header fields used on the wire.

Header fields: ``k`` kind, ``i`` request id, ``r`` sender rank, ``d`` target ranks,
``q`` per-target sequence numbers (FIFO per sender), ``f`` forward through the host
agent, ``w`` a reply is wanted, ``b`` buffer sizes (set by the codec).
"""

# controller -> host agent
SPAWN_RANKS = "spawn_ranks"
SIGNAL_RANKS = "signal_ranks"
KILL_RANKS = "kill_ranks"
STOP = "stop"
HEARTBEAT = "hb"
#: Connection probe: proves a ROUTER peer is routable before real messages go to it.
HELLO = "hello"

# host agent -> controller
HOST_READY = "host_ready"
RANK_STARTED = "rank_started"
RANK_EXIT = "rank_exit"

# controller -> rank (ordered, main thread)
SPAWN_ACTOR = "spawn_actor"
CALL = "call"
EXEC = "exec"
STOP_ACTOR = "stop_actor"

# controller -> rank control thread (unordered, served while the main thread is busy)
PUSH = "push"
PULL = "pull"
PING = "ping"
CANCEL = "cancel"  # header "c": the request to interrupt (running) or skip (not started)

# rank -> controller
READY = "ready"
RESULT = "res"
STREAM = "out"
METRIC = "metric"
FAULT = "fault"
STATS = "stats"  # once a second from each rank: memory and data-plane byte counters
