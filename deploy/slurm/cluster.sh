# DualPath on a Slurm allocation: sourced by dualpath.sbatch and rollout.sbatch from inside the batch shell.
#
# Layout (roles assigned by node): the first DUALPATH_PREFILL_NODES nodes of the allocation run prefill engines,
# the rest decode engines, one engine per GPU (one `srun` task per GPU, Slurm sets its CUDA_VISIBLE_DEVICES), or
# with DUALPATH_TP=N one engine per N GPUs (one task per N GPUs: the engine's N tensor-parallel ranks on them).
# The scheduler and the OpenAI frontend run in the batch shell on the first node; engines find the scheduler
# through DUALPATH_SCHEDULER, exported into their job steps. Every setting below may be overridden from the
# environment at sbatch time (sbatch exports the submitting shell's environment).
#
# Shutdown: on SIGTERM (scancel --batch --signal=TERM, or --signal=B:TERM@120 before the time limit) the frontend
# stops first (no new requests), then the engines (each drains and deregisters), then the scheduler; the batch
# shell exits 0.
#
# Self-healing: a part that exits on its own while the job is not stopping (the scheduler, a role's engine step, the
# frontend) is started again the same way, after a backoff of 1 s doubling per recent restart up to 30 s, at most
# DUALPATH_MAX_RESTARTS times in 10 minutes per part; past that the job stops and exits 1. The scheduler comes back
# on its port (engines register again keeping their work, the frontend resubmits what had not started); a role's
# step comes back on the same nodes with the same engine names (--kill-on-bad-exit: one dead task ends its step, so
# the role's engines restart together). DUALPATH_MAX_RESTARTS=0: any part dying stops the job at once.
#
# Security (deploy/README.md, "Security"): the job runs under umask 077 (its run directory, logs, KV blocks and stored
# responses are the user's alone; srun passes the umask to the engine tasks); a per-job cluster token, a 0600 file in
# the run directory, authenticates every gRPC call between the parts (DUALPATH_CLUSTER_TOKEN_FILE, exported into
# every part); a frontend listening beyond the node (DUALPATH_HOST, 0.0.0.0 by default) needs an API key
# (DUALPATH_API_KEY or DUALPATH_API_KEY_FILE), else the job fails at start. The keys reach the frontend only.

: "${DUALPATH_PREFILL_NODES:=1}"                   # nodes running prefill engines; the others run decode
: "${DUALPATH_GPUS_PER_NODE:=${SLURM_GPUS_ON_NODE:-8}}"  # GPUs per node: engines per node at DUALPATH_TP=1
: "${DUALPATH_TP:=1}"                             # tensor-parallel size: one engine spans this many of a node's GPUs
: "${DUALPATH_EXPERT_PARALLEL:=0}"            # 1: MoE models' experts whole per rank (--enable-expert-parallel)
: "${DUALPATH_DATA_PARALLEL:=0}"              # 1: a node's engines form one data-parallel attention group (TP 1)
: "${DUALPATH_DP_PORT:=29650}"                # where a node's group meets (prefill; decode one above)
: "${DUALPATH_PREFILL_TP:=$DUALPATH_TP}"          # the prefill engines' own (e.g. 2 while decode runs 1)
: "${DUALPATH_DECODE_TP:=$DUALPATH_TP}"           # the decode engines' own
: "${DUALPATH_DEVICE:=cuda}"                      # cpu: engines on CPU (trials, CI)
: "${DUALPATH_GPUS_PER_TASK:=1}"                  # GPUs (gres) each engine task gets; 0 on nodes without GPUs
: "${DUALPATH_DTYPE:=bfloat16}"
: "${DUALPATH_KV_CACHE_DTYPE:=auto}"
: "${DUALPATH_QUANTIZATION:=}"                    # fp8: a plain checkpoint's linear weights quantized at load
: "${DUALPATH_SHARED_DIR:=${SLURM_SUBMIT_DIR:-$PWD}/dualpath-shared}"  # a mount every node sees (3FS, Lustre, NFS)
: "${DUALPATH_KV_STORE:=$DUALPATH_SHARED_DIR/kv}" # the KV store: must be the same files on every node
: "${DUALPATH_STORAGE_CAPACITY:=0}"               # its cap, e.g. 50T (LRU eviction past it; 0: none, the mount's quota)
: "${DUALPATH_MODEL:=}"                           # checkpoint directory on the shared mount (default: SmolLM2)
: "${DUALPATH_LORA_MODULES:=}"                    # LoRA adapters served as models: "NAME=PATH ..." on the shared mount
: "${DUALPATH_TRANSPORT:=ucx}"                    # ucx, nixl or verbs across nodes
: "${DUALPATH_KV_SL:=2}"                          # InfiniBand service level of KV traffic (deploy/qos)
: "${DUALPATH_KV_DSCP:=10}"                       # DSCP of KV traffic: RoCE traffic class / TCP IP_TOS = DSCP << 2
: "${DUALPATH_COLLECTIVE_SL:=${DUALPATH_NCCL_SL:-0}}"  # InfiniBand service level of the collectives (NCCL_IB_SL)
: "${DUALPATH_COLLECTIVE_DSCP:=26}"               # DSCP of the collectives (NCCL_IB_TC = DSCP << 2)
if [ -n "${DUALPATH_KV_TC:-}" ]; then             # the former setting: a traffic class byte
  DUALPATH_KV_DSCP=$((DUALPATH_KV_TC >> 2))
fi
: "${DUALPATH_PORT:=8000}"                        # the OpenAI endpoint, on the first node
: "${DUALPATH_HOST:=0.0.0.0}"                     # the frontend's bind address; beyond loopback it needs an API key
: "${DUALPATH_API_KEY_FILE:=}"                    # a file holding the frontend's key (else DUALPATH_API_KEY)
: "${DUALPATH_ALLOW_NO_KEY:=0}"                   # 1: serve beyond the node without a key (closed test clusters only)
: "${DUALPATH_CLUSTER_TOKEN_FILE:=}"              # the cluster token's file (0600); empty: one made per job
: "${DUALPATH_UMASK:=077}"                        # the job's umask: what it writes is the user's alone
: "${DUALPATH_DRAIN_TIMEOUT:=50}"                 # seconds the stopping frontend lets requests finish (< dp_stop's 60)
: "${DUALPATH_SCHEDULER_PORT:=50051}"
: "${DUALPATH_SCHEDULER_HTTP_PORT:=9400}"         # the scheduler's /metrics
: "${DUALPATH_SCHEDULER_HOST:=0.0.0.0}"           # the scheduler's bind address (engines reach it at the node's NodeAddr)
: "${DUALPATH_SCHEDULING_POLICY:=fcfs}"           # or priority: requests' priority field orders the queues
: "${DUALPATH_ENGINE_ARGS:=}"                     # more `dualpath engine` options, e.g. "--buffer-bytes 8589934592"
: "${DUALPATH_FRONTEND_ARGS:=}"                   # more `dualpath frontend` options, e.g. "--tool-call-parser hermes"
: "${DUALPATH_SCHEDULER_ARGS:=}"                  # more `dualpath scheduler` options, e.g. "--disable-priority-preemption"
: "${DUALPATH_START_TIMEOUT:=900}"
: "${DUALPATH_MAX_RESTARTS:=5}"                   # restarts of a part that exits on its own, per 10 min; 0: the job fails
: "${DUALPATH_RUN_DIR:=$DUALPATH_SHARED_DIR/run-${SLURM_JOB_ID:-local}}"  # logs, and the endpoint file
: "${DUALPATH:=dualpath}"                         # the command (a venv's bin/dualpath, or a container wrapper)

# the fabric classes (deploy/qos/README.md): NCCL's for the collectives (the engines set them too, from their flags),
# UCX's for KV (NIXL's UCX takes them from here; the ucx transport sets them on its KV context itself)
export NCCL_IB_SL="$DUALPATH_COLLECTIVE_SL" NCCL_IB_TC="$((DUALPATH_COLLECTIVE_DSCP << 2))"
export UCX_IB_SL="$DUALPATH_KV_SL" UCX_IB_TRAFFIC_CLASS="$((DUALPATH_KV_DSCP << 2))"
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
unset DUALPATH_PARENT_PID

declare -gA DP_PART=()      # the live process of each part: scheduler, prefill, decode (srun steps), frontend
declare -gA DP_LAUNCH=()    # the command that (re)starts a part
declare -gA DP_RESTARTS=()  # when ($SECONDS) each part was restarted
DP_PIDS=()       # scheduler, frontend, engine steps (DP_PART's values): the job lives while all of them do
DP_STEPS=()      # the engine srun steps (stopped before the scheduler)
DP_SCHEDULER="" DP_FRONTEND=""
DP_STOPPING=0
DP_LAUNCHING=0 DP_SIGNALED=0  # a TERM/INT while a part is being started waits until its pid is recorded
DP_RESTART_WINDOW=600         # seconds over which a part's restarts count (backoff and DUALPATH_MAX_RESTARTS)
DP_TOKEN_MADE=0               # 1: this job made DUALPATH_CLUSTER_TOKEN_FILE (removed when the job stops)

dp_log() { echo "[dualpath $(date +%H:%M:%S)] $*" >&2; }

# The address other nodes reach NODE at: Slurm's NodeAddr (the host name when none is configured).
dp_node_addr() {
  local addr
  addr=$(scontrol show node "$1" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
  echo "${addr:-$1}"
}

dp_is_loopback() { case $1 in 127.* | localhost | ::1 | '[::1]') return 0 ;; *) return 1 ;; esac; }

# The frontend's key: a frontend reachable beyond this node (DUALPATH_HOST not loopback) serves only with one,
# unless DUALPATH_ALLOW_NO_KEY=1 says the network is closed. Runs before anything starts: a refusal fails the job.
dp_check_api_key() {
  if [ -n "$DUALPATH_API_KEY_FILE" ]; then  # a file keeps the key out of the job's recorded environment
    if [ ! -r "$DUALPATH_API_KEY_FILE" ]; then
      dp_log "DUALPATH_API_KEY_FILE=$DUALPATH_API_KEY_FILE cannot be read"; return 2
    fi
    DUALPATH_API_KEY=$(<"$DUALPATH_API_KEY_FILE")
    export DUALPATH_API_KEY
  fi
  [ -z "${DUALPATH_API_KEY:-}" ] || return 0
  dp_is_loopback "$DUALPATH_HOST" && return 0
  if [ "$DUALPATH_ALLOW_NO_KEY" = 1 ]; then
    dp_log "WARNING: the frontend listens on $DUALPATH_HOST:$DUALPATH_PORT without an API key" \
      "(DUALPATH_ALLOW_NO_KEY=1): anyone who reaches the node can use the model"
    return 0
  fi
  dp_log "refusing to start: the frontend would listen on $DUALPATH_HOST:$DUALPATH_PORT, beyond this node, without" \
    "an API key. Set DUALPATH_API_KEY (or DUALPATH_API_KEY_FILE, a file holding it) when submitting, or" \
    "DUALPATH_HOST=127.0.0.1 to serve this node only; on a closed test cluster DUALPATH_ALLOW_NO_KEY=1 allows it."
  return 2
}

# The cluster token every part authenticates with: DUALPATH_CLUSTER_TOKEN as given, the file DUALPATH_CLUSTER_TOKEN_FILE
# names (it must be the user's alone), or a new random one in the run directory (umask 077: never readable by
# others, not even for an instant), removed when the job stops. The run directory is on the shared mount, so every
# node reads the same file; srun steps get the variable with the rest of the environment (--export=ALL).
dp_cluster_token() {
  if [ -n "${DUALPATH_CLUSTER_TOKEN:-}" ]; then export DUALPATH_CLUSTER_TOKEN; return 0; fi
  if [ -z "$DUALPATH_CLUSTER_TOKEN_FILE" ]; then
    DUALPATH_CLUSTER_TOKEN_FILE=$DUALPATH_RUN_DIR/cluster-token
    rm -f "$DUALPATH_CLUSTER_TOKEN_FILE"
    (umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$DUALPATH_CLUSTER_TOKEN_FILE") || {
      dp_log "cannot write the cluster token $DUALPATH_CLUSTER_TOKEN_FILE"; return 1; }
    DP_TOKEN_MADE=1
  elif [ ! -r "$DUALPATH_CLUSTER_TOKEN_FILE" ]; then
    dp_log "DUALPATH_CLUSTER_TOKEN_FILE=$DUALPATH_CLUSTER_TOKEN_FILE cannot be read"; return 2
  elif [ $((8#$(stat -c %a "$DUALPATH_CLUSTER_TOKEN_FILE") & 8#077)) != 0 ]; then
    dp_log "DUALPATH_CLUSTER_TOKEN_FILE=$DUALPATH_CLUSTER_TOKEN_FILE is readable by others: chmod 600 it"; return 2
  fi
  export DUALPATH_CLUSTER_TOKEN_FILE
}

dp_model_args() {
  if [ -z "$DUALPATH_MODEL" ]; then  # convert the default model once, onto the shared mount every node reads
    DUALPATH_MODEL=$("$DUALPATH" convert-default-model --dir "$DUALPATH_SHARED_DIR/models" | tail -n 1)
  fi
  echo "--model $DUALPATH_MODEL${DUALPATH_LORA_MODULES:+ --lora-modules $DUALPATH_LORA_MODULES}"
}

dp_role_tp() {  # the tensor-parallel size of ROLE's engines
  if [ "$1" = prefill ]; then echo "$DUALPATH_PREFILL_TP"; else echo "$DUALPATH_DECODE_TP"; fi
}

# Each role's tensor-parallel size: a whole number dividing DUALPATH_GPUS_PER_NODE (a node's GPUs are its engines').
dp_check_tp() {
  local role tp
  for role in prefill decode; do
    tp=$(dp_role_tp "$role")
    case $tp in
      '' | 0* | *[!0-9]*) dp_log "the $role engines' tensor-parallel size must be a whole number from 1, got '$tp'"
                          return 2 ;;
    esac
    if [ $((DUALPATH_GPUS_PER_NODE % tp)) != 0 ]; then
      dp_log "the $role engines' tensor-parallel size $tp (DUALPATH_TP, DUALPATH_${role^^}_TP) does not divide" \
        "DUALPATH_GPUS_PER_NODE=$DUALPATH_GPUS_PER_NODE"
      return 2
    fi
    if [ "$DUALPATH_DATA_PARALLEL" = 1 ] && [ "$tp" != 1 ]; then
      dp_log "DUALPATH_DATA_PARALLEL=1 runs one GPU per engine: the $role engines' tensor-parallel size is $tp"
      return 2
    fi
  done
}

dp_engines_per_node() { echo $((DUALPATH_GPUS_PER_NODE / $(dp_role_tp "$1"))); }  # ROLE's engines on one node

# One srun step per role: NODES (comma list), one task per engine (per GPU at TP 1, else per TP GPUs, which Slurm
# gives the task as its CUDA_VISIBLE_DEVICES: the engine's ranks on cuda:0 .. cuda:TP-1); each task is one engine
# named role-node-index.
dp_run_engines() {
  local role=$1 nodes=$2 count=$3 tp per_node
  tp=$(dp_role_tp "$role") per_node=$(dp_engines_per_node "$role")
  dp_log "starting $role engines on $nodes ($per_node per node, tensor-parallel size $tp)"
  # --export=ALL, whatever the site's default: the tasks need the DUALPATH_* settings and the cluster token (the
  # frontend's keys are taken out of srun's environment first)
  env -u DUALPATH_API_KEY -u DUALPATH_ADMIN_API_KEY srun --export=ALL --nodes="$count" --nodelist="$nodes" \
    --ntasks-per-node="$per_node" \
    $([ "$DUALPATH_GPUS_PER_TASK" -gt 0 ] && echo "--gpus-per-task=$((DUALPATH_GPUS_PER_TASK * tp))") \
    --cpus-per-task="$tp" --kill-on-bad-exit=1 --job-name="dualpath-$role" \
    bash -c 'exec >>"$DUALPATH_RUN_DIR/$0-$SLURMD_NODENAME-$SLURM_LOCALID.log" 2>&1
      echo "engine task $SLURM_LOCALID on $SLURMD_NODENAME: CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-}" >&2
      addr=$(scontrol show node "$SLURMD_NODENAME" | grep -o "NodeAddr=[^ ]*" | cut -d= -f2)
      dp_port=$DUALPATH_DP_PORT; [ "$0" = decode ] && dp_port=$((DUALPATH_DP_PORT + 1))
      dp_args=""  # data-parallel attention: the engines of this node are one group, meeting at its first task
      [ "${DUALPATH_DATA_PARALLEL:-0}" = 1 ] && dp_args="--data-parallel-size $SLURM_NTASKS_PER_NODE"\
" --data-parallel-rank $SLURM_LOCALID --data-parallel-master $addr:$dp_port"
      exec "$DUALPATH" --log-level INFO engine --role "$0" --scheduler "$DUALPATH_SCHEDULER" \
      --engine-id "$0-$SLURMD_NODENAME-$SLURM_LOCALID" --node-id "$SLURMD_NODENAME" --group-id "$0-$SLURMD_NODENAME" \
      --host "$addr" --device "$DUALPATH_ENGINE_DEVICE" --tensor-parallel-size "$1" $dp_args \
      $([ "${DUALPATH_EXPERT_PARALLEL:-0}" = 1 ] && echo --enable-expert-parallel) \
      --dtype "$DUALPATH_DTYPE" --kv-cache-dtype "$DUALPATH_KV_CACHE_DTYPE" \
      --transport "$DUALPATH_TRANSPORT" ${DUALPATH_QUANTIZATION:+--quantization "$DUALPATH_QUANTIZATION"} \
      --kv-store "$DUALPATH_KV_STORE" --storage-capacity "$DUALPATH_STORAGE_CAPACITY" \
      --kv-service-level "$DUALPATH_KV_SL" --kv-dscp "$DUALPATH_KV_DSCP" \
      --collective-service-level "$DUALPATH_COLLECTIVE_SL" --collective-dscp "$DUALPATH_COLLECTIVE_DSCP" \
      --torch-threads 1 $DUALPATH_MODEL_ARGS $DUALPATH_ENGINE_ARGS' "$role" "$tp" &
}

dp_run_scheduler() {  # (env -u: the frontend's keys are the frontend's alone)
  env -u DUALPATH_API_KEY -u DUALPATH_ADMIN_API_KEY "$DUALPATH" scheduler --host "$DUALPATH_SCHEDULER_HOST" \
    --port "$DUALPATH_SCHEDULER_PORT" --kv-store "$DUALPATH_KV_STORE" \
    --http-port "$DUALPATH_SCHEDULER_HTTP_PORT" --scheduling-policy "$DUALPATH_SCHEDULING_POLICY" $DUALPATH_SCHEDULER_ARGS \
    >>"$DUALPATH_RUN_DIR/scheduler.log" 2>&1 &
}

dp_run_frontend() {  # its key comes from the environment (DUALPATH_API_KEY), never its command line (ps shows that)
  "$DUALPATH" frontend --scheduler "$DUALPATH_SCHEDULER" --host "$DUALPATH_HOST" --port "$DUALPATH_PORT" \
    --responses-dir "$DUALPATH_KV_STORE/responses" --drain-timeout "$DUALPATH_DRAIN_TIMEOUT" \
    $DUALPATH_MODEL_ARGS $DUALPATH_FRONTEND_ARGS >>"$DUALPATH_RUN_DIR/frontend.log" 2>&1 &
}

# dp_start PART COMMAND...: run COMMAND (it starts PART's process in the background) and record that process as the
# part's; never once a shutdown began (1). A TERM or INT meanwhile is held until then, so the shutdown stops it too.
dp_start() {
  local part=$1; shift
  [ "$DP_STOPPING" = 0 ] || return 1
  DP_LAUNCH[$part]="$*" DP_LAUNCHING=1
  "$@"
  DP_PART[$part]=$!
  dp_sync_pids
  DP_LAUNCHING=0
  [ "$DP_SIGNALED" = 0 ] || { dualpath_cluster_down; return 1; }
}

dp_sync_pids() {  # DP_PIDS, DP_STEPS, DP_SCHEDULER, DP_FRONTEND: the parts' live processes
  DP_PIDS=("${DP_PART[@]}")
  DP_STEPS=(${DP_PART[prefill]:-} ${DP_PART[decode]:-})
  DP_SCHEDULER=${DP_PART[scheduler]:-} DP_FRONTEND=${DP_PART[frontend]:-}
}

dp_on_signal() {  # TERM/INT: the ordered shutdown, once the part being started (if any) is recorded
  if [ "$DP_LAUNCHING" = 1 ]; then DP_SIGNALED=1; else dualpath_cluster_down; fi
}

# Start scheduler, engines and frontend; return once every engine has registered and the frontend is up.
dualpath_cluster_up() {
  case $DUALPATH_MAX_RESTARTS in
    '' | *[!0-9]*) dp_log "DUALPATH_MAX_RESTARTS must be a whole number, got '$DUALPATH_MAX_RESTARTS'"; return 2 ;;
  esac
  dp_check_tp || return
  dp_check_api_key || return
  umask "$DUALPATH_UMASK" || return 2
  mkdir -p "$DUALPATH_RUN_DIR" "$DUALPATH_KV_STORE"
  chmod 700 "$DUALPATH_RUN_DIR"  # logs and the token: the user's alone, even where the directory existed
  rm -f "$DUALPATH_RUN_DIR/endpoint"
  dp_cluster_token || return
  trap dp_on_signal TERM INT
  mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  local np=$DUALPATH_PREFILL_NODES nd=$((${#nodes[@]} - DUALPATH_PREFILL_NODES))
  if [ "$np" -lt 1 ] || [ "$nd" -lt 1 ]; then
    dp_log "need at least one prefill and one decode node: ${#nodes[@]} nodes, DUALPATH_PREFILL_NODES=$np"
    return 2
  fi
  local head; head=$(dp_node_addr "${nodes[0]}")
  export DUALPATH_SCHEDULER="$head:$DUALPATH_SCHEDULER_PORT" DUALPATH_MODEL_ARGS
  export DUALPATH_ENGINE_DEVICE=$([ "$DUALPATH_DEVICE" = cuda ] && echo cuda:0 || echo "$DUALPATH_DEVICE")
  export DUALPATH DUALPATH_DTYPE DUALPATH_TRANSPORT DUALPATH_KV_STORE DUALPATH_STORAGE_CAPACITY DUALPATH_KV_SL DUALPATH_KV_DSCP DUALPATH_ENGINE_ARGS \
    DUALPATH_COLLECTIVE_SL DUALPATH_COLLECTIVE_DSCP DUALPATH_RUN_DIR DUALPATH_KV_CACHE_DTYPE DUALPATH_QUANTIZATION
  DUALPATH_MODEL_ARGS=$(dp_model_args) || return 1
  dp_log "job ${SLURM_JOB_ID:-?}: ${np} prefill + ${nd} decode nodes, scheduler $DUALPATH_SCHEDULER, logs $DUALPATH_RUN_DIR"

  dp_start scheduler dp_run_scheduler || return 1
  dp_start prefill dp_run_engines prefill "$(IFS=,; echo "${nodes[*]:0:np}")" "$np" || return 1
  dp_start decode dp_run_engines decode "$(IFS=,; echo "${nodes[*]:np}")" "$nd" || return 1
  dp_wait_registered $((np * $(dp_engines_per_node prefill))) $((nd * $(dp_engines_per_node decode))) || {
      dp_log "engines did not come up; see $DUALPATH_RUN_DIR"; dualpath_cluster_down; return 1; }

  dp_start frontend dp_run_frontend || return 1
  local host=$head deadline=$((SECONDS + 300))
  case $DUALPATH_HOST in 0.0.0.0 | :: | '[::]') ;; *) host=$DUALPATH_HOST ;; esac  # bound to one address: that one
  local url="http://$host:$DUALPATH_PORT"
  until curl -sf "$url/health" >/dev/null 2>&1 || python3 -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1])" "$url/health" 2>/dev/null; do
    if ! kill -0 "$DP_FRONTEND" 2>/dev/null || [ $SECONDS -gt $deadline ]; then
      dp_log "frontend did not come up:"; tail -n 20 "$DUALPATH_RUN_DIR/frontend.log" >&2
      dualpath_cluster_down; return 1
    fi
    sleep 1
  done
  echo "$url" >"$DUALPATH_RUN_DIR/endpoint"
  dp_log "serving at $url/v1 (scheduler metrics at http://$head:$DUALPATH_SCHEDULER_HTTP_PORT/metrics)"
}

# Wait until P prefill and D decode engines registered; fail at once when a part (scheduler, engine step) dies
# first, instead of waiting out DUALPATH_START_TIMEOUT.
dp_wait_registered() {
  "$DUALPATH" status --scheduler "$DUALPATH_SCHEDULER" --timeout "$DUALPATH_START_TIMEOUT" \
    --wait-prefill "$1" --wait-decode "$2" >&2 &
  local waiter=$! p
  while kill -0 "$waiter" 2>/dev/null; do
    for p in "${DP_PIDS[@]}"; do  # one at a time: `kill -0 a b` succeeds while any of them lives
      if ! kill -0 "$p" 2>/dev/null; then
        kill "$waiter" 2>/dev/null; wait "$waiter" 2>/dev/null
        dp_log "process $p exited during start-up"; return 1
      fi
    done
    sleep 1
  done
  wait "$waiter"
}

# Keep the parts up until a shutdown signal (0), a part exits once more than it may be restarted (the job stops, 1),
# or MAIN, if given (the rollout), exits (its status; the caller stops the cluster).
dualpath_cluster_wait() {
  local main=${1:-}
  while [ "$DP_STOPPING" = 0 ]; do
    wait -n ${main:+"$main"} "${DP_PIDS[@]}" 2>/dev/null
    [ "$DP_STOPPING" = 0 ] || break
    if [ -n "$main" ] && ! kill -0 "$main" 2>/dev/null; then wait "$main"; return; fi
    dp_heal || { [ -z "$main" ] || dp_stop "$main"; dualpath_cluster_down; return 1; }
  done
  return 0
}

dp_heal() {  # restart each part whose process exited; 1 when one may not be restarted any more
  local part
  for part in "${!DP_PART[@]}"; do
    [ "$DP_STOPPING" = 0 ] || return 0
    kill -0 "${DP_PART[$part]}" 2>/dev/null || dp_restart "$part" || return 1
  done
}

# PART's process exited on its own: start it again after a backoff (1 s, doubling per restart in the last
# DP_RESTART_WINDOW seconds, at most 30 s); 1 when it was restarted DUALPATH_MAX_RESTARTS times in that window.
dp_restart() {
  local part=$1 pid=${DP_PART[$1]} what=$1 rc n delay
  case $part in prefill | decode) what="$part engine step" ;; esac
  wait "$pid"; rc=$?
  if [ "$DUALPATH_MAX_RESTARTS" = 0 ]; then dp_log "process $pid exited on its own; stopping the job"; return 1; fi
  n=$(dp_recent_restarts "$part")
  if [ "$n" -ge "$DUALPATH_MAX_RESTARTS" ]; then
    dp_log "process $pid ($what, status $rc) exited on its own after $n restarts in $DP_RESTART_WINDOW s;" \
      "stopping the job"
    return 1
  fi
  delay=$((n >= 5 ? 30 : 1 << n))
  dp_log "$what (process $pid) exited with status $rc; restarting it in $delay s" \
    "(restart $((n + 1)) of at most $DUALPATH_MAX_RESTARTS in $DP_RESTART_WINDOW s)"
  dp_sleep "$delay"
  DP_RESTARTS[$part]+=" $SECONDS"
  dp_start "$part" ${DP_LAUNCH[$part]} || return 0  # (a shutdown began meanwhile: it stays down)
  dp_log "$what restarted (process ${DP_PART[$part]})"
}

dp_recent_restarts() {  # how often PART was restarted in the last DP_RESTART_WINDOW seconds
  local t n=0
  for t in ${DP_RESTARTS[$1]:-}; do [ $((SECONDS - t)) -ge "$DP_RESTART_WINDOW" ] || n=$((n + 1)); done
  echo "$n"
}

dp_sleep() {  # sleep SECONDS; a shutdown signal cuts it short (its trap runs at once)
  sleep "$1" &
  local s=$!
  wait "$s" 2>/dev/null || kill "$s" 2>/dev/null
}

dp_stop() {  # SIGTERM the PIDS, wait up to 60 s, then SIGKILL what is left
  [ $# -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null
  local deadline=$((SECONDS + 60))
  while kill -0 "$@" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.5; done  # true while any lives
  kill -KILL "$@" 2>/dev/null
  wait "$@" 2>/dev/null || true
}

# SIGTERM every engine task directly (srun itself answers SIGTERM by killing its step), wait for the steps to end.
dp_stop_engines() {
  [ ${#DP_STEPS[@]} -gt 0 ] || return 0
  local step
  for step in $(squeue -h -s -j "$SLURM_JOB_ID" -o "%i %j" 2>/dev/null | awk '$2 ~ /^dualpath-(prefill|decode)$/ {print $1}'); do
    scancel --signal=TERM "$step" 2>/dev/null
  done
  local deadline=$((SECONDS + 60))
  while kill -0 "${DP_STEPS[@]}" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.5; done
  dp_stop "${DP_STEPS[@]}"
}

# Ordered shutdown: frontend (no new requests), engines (each finishes its loop and closes its transport), scheduler.
dualpath_cluster_down() {
  [ "$DP_STOPPING" = 1 ] && return 0
  DP_STOPPING=1
  trap - TERM INT
  dp_log "shutting down"
  rm -f "$DUALPATH_RUN_DIR/endpoint"
  dp_stop ${DP_FRONTEND:-}
  dp_stop_engines
  dp_stop ${DP_SCHEDULER:-}
  [ "$DP_TOKEN_MADE" = 0 ] || rm -f "$DUALPATH_CLUSTER_TOKEN_FILE"  # this job's token dies with it
  dp_log "stopped"
}
