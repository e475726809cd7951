/**
 * The types of the jupyter_evalsched REST API, generated from the server's OpenAPI document
 * (jupyter_evalsched/openapi.py, built from its pydantic models).
 *
 * DO NOT EDIT: run `PYTHONPATH=. python scripts/gen_api_types.py` from the repository root.
 * tests/test_api_types.py fails when this file is stale.
 */

/** How an earlier attempt of a run ended (the record's ``history``). */
export interface IAttemptEnd {
  attempt: number;
  state: 'failed' | 'cancelled' | 'aborted' | 'preempted';
  reason: string | null;
  started_at: string | null;
  finished_at: string | null;
  episodes_done: number;
}

export interface IBrokenRun {
  id: string;
  /** why its directory cannot be used */
  problem: string;
}

export interface IChatCompletion {
  id: string;
  object: 'chat.completion';
  created: number;
  model: string;
  choices: {
    index: number;
    message: {
      role: 'assistant';
      content: string;
    };
    logprobs: {
      content: IChatTokenLogprob[];
    } | null;
    finish_reason: 'stop' | 'length';
  }[];
  usage: IOpenAIUsage;
}

export interface IChatCompletionRequest {
  model: string;
  messages: {
    role: string;
    content?: unknown;
  }[];
  max_tokens?: number;
  max_completion_tokens?: number;
  temperature?: number;
  top_p?: number;
  seed?: number;
  stop?: string | string[];
  logprobs?: boolean;
  top_logprobs?: number;
  stream?: boolean;
  stream_options?: {
    include_usage?: boolean;
  };
}

export interface IChatTokenLogprob {
  token: string;
  logprob: number;
  bytes: number[];
  top_logprobs?: IChatTokenLogprob[];
}

export interface ICompareRow {
  id: string;
  name: string | null;
  state: string | null;
  /** the values of the parameters that differ between the runs */
  params: { [key: string]: unknown };
  metrics: { [key: string]: IMetricStat };
  delta: { [key: string]: IMetricDelta };
  /** finished_at - started_at */
  wall_s: number | null;
  /** the observed VRAM peak, summed over its GPUs */
  peak_vram_mb: number | null;
  /** why its spec or episodes could not be read */
  error: string | null;
}

export interface IComparison {
  /** the names of the parameters whose values differ */
  params: string[];
  /** the metric names compared: at most MAX_METRIC_NAMES (256), the first seen */
  metrics: string[];
  /** metric names left out beyond MAX_METRIC_NAMES */
  metrics_dropped: number;
  /** the run the deltas are against */
  baseline: string | null;
  rows: ICompareRow[];
}

export interface ICompletion {
  id: string;
  object: 'text_completion';
  created: number;
  model: string;
  choices: {
    index: number;
    text: string;
    logprobs: ILegacyLogprobs | null;
    finish_reason: 'stop' | 'length';
  }[];
  usage: IOpenAIUsage;
}

export interface ICompletionRequest {
  model: string;
  /** a string, a list of strings, token ids, or a list of token id lists */
  prompt: string | string[] | number[] | number[][];
  max_tokens?: number;
  temperature?: number;
  top_p?: number;
  seed?: number;
  stop?: string | string[];
  echo?: boolean;
  logprobs?: number | null;
  stream?: boolean;
  stream_options?: {
    include_usage?: boolean;
  };
}

export interface ICpuSlots {
  total: number;
  allocated: number;
}

export interface IDoctorCheck {
  name: string;
  status: 'ok' | 'degraded' | 'error';
  detail: string;
  /** what to do about it, when it is not ok */
  fix: string | null;
}

/** ``GET /evalsched/doctor``: what this host offers and what is in force. */
export interface IDoctorReport {
  checks: IDoctorCheck[];
}

export interface IEmbeddingList {
  object: 'list';
  data: {
    object: 'embedding';
    /** floats, or base64 of little-endian float32 (encoding_format base64) */
    embedding: number[] | string;
    index: number;
  }[];
  model: string;
  usage: {
    prompt_tokens: number;
    total_tokens: number;
  };
}

export interface IEmbeddingRequest {
  model: string;
  input: string | string[];
  encoding_format?: 'float' | 'base64';
}

export interface IEpisodeList {
  /** the episodes of this page's lines, in file order (lines that are not episodes skipped) */
  episodes: { [key: string]: unknown }[];
  /** the offset of the next page; null when this page reached the end of the file */
  next_offset: number | null;
  /** the complete lines of episodes.jsonl when it was read (the run may append) */
  total: number;
}

export interface IErrorBody {
  message: string;
  reason: string | null;
  detail: { [key: string]: unknown }[] | null;
}

/** A submitted evaluation. Defaults are filled in before it is written as ``spec.json``. */
export interface IEvalSpec {
  name?: string | null;
  /** pkg.module:function or path/file.py:function */
  entrypoint?: string | null;
  /** source of eval.py */
  source?: string | null;
  episodes?: number;
  params?: { [key: string]: unknown };
  workers?: number;
  seed?: number;
  models?: string[];
  env?: { [key: string]: string };
  cwd?: string | null;
  timeout_s?: number | null;
  depends_on?: string[];
  scheduling?: IScheduling;
  /** where the run executes: this host's ledger ('local') or SLURM; default: the server's */
  executor?: 'local' | 'slurm' | null;
  /** automatic resumes after a failure named in retry_on */
  retries?: number;
  /** the reason codes of failures that are retried: exception, exit_code, signal, oom, timeout, over_vram, model_unavailable */
  retry_on?: string[];
  /** the run does not die with the server; a restarted server re-attaches it */
  detach?: boolean;
  /** start the run in a fresh interpreter, never forked from a warm zygote */
  fresh_interpreter?: boolean;
}

/** What stands in a pending job's way (contract.Holder). */
export interface IHolder {
  kind: 'run' | 'lease' | 'kernel' | 'process' | 'model' | 'user';
  /** a run's or lease's id, a kernel's id, a process's pid */
  id: string | null;
  /** a run's name, a lease's label, a kernel's notebook path */
  name: string | null;
  /** the GPU it holds (NVML order), when that is what blocks */
  gpu: number | null;
  /** the VRAM it holds on that GPU */
  mb: number | null;
}

/** The link to the host ledger of a host shared by several users. */
export interface IHostLedgerStatus {
  /** its Unix socket */
  socket: string;
  connected: boolean;
  /** this server's user, as the host ledger knows it (from the kernel) */
  user: string | null;
  /** why it is not connected, when it is not */
  error: string | null;
}

export interface ILeaseList {
  leases: ILeaseRecord[];
}

/** A lease, as REST answers it, events carry it and ``<runs_dir>/.leases/<id>.json`` holds it. */
export interface ILeaseRecord {
  id: string;
  state: 'queued' | 'granted' | 'ended';
  /** why it waits, or how it ended (released, process_exited, ttl_expired) */
  reason: string | null;
  /** why it waits, as data (its reason is derived from it); null once granted */
  why: IWhy | null;
  vram_mb: number;
  gpus: number;
  exclusive_gpu: boolean;
  priority: 'high' | 'normal' | 'low';
  /** the leased GPU indices (NVML order) once granted */
  devices?: number[];
  /** the CUDA_VISIBLE_DEVICES value that shows the leased GPUs */
  cuda_visible_devices: string | null;
  pid: number | null;
  pid_create_time: number | null;
  label: string;
  /** the notebook kernel that holds the lease, when its pid is one */
  kernel_id: string | null;
  /** that kernel's notebook */
  session_path: string | null;
  ttl_s: number | null;
  requested_at: string;
  granted_at: string | null;
  ended_at: string | null;
  seq: number;
  /** VRAM its process (and children) use now, per GPU index (NVML) */
  observed_mb?: { [key: string]: number };
  /** how much more than leased its process uses, summed over GPUs */
  over_lease_mb: number;
}

/** ``POST /evalsched/leases``: VRAM for interactive work, admitted like a run. */
export interface ILeaseRequest {
  /** VRAM per GPU, in MB */
  vram_mb?: number;
  gpus?: number;
  /** nothing else on the leased GPUs (the interactive lock) */
  exclusive_gpu?: boolean;
  /** lane: a person is waiting */
  priority?: 'high' | 'normal' | 'low';
  /** the lease ends when this process exits */
  pid?: number | null;
  /** the lease ends this long after its grant */
  ttl_s?: number | null;
  /** shown in the ledger and in the reasons of what waits */
  label?: string;
}

export interface ILedger {
  devices: ILedgerDevice[];
  cpu_slots: ICpuSlots;
}

export interface ILedgerDevice {
  index: number;
  name: string;
  total_mb: number;
  /** VRAM the loaded shared models hold (part of allocated_mb) */
  baseline_mb: number;
  usable_mb: number;
  allocated_mb: number;
  free_mb: number;
  /** VRAM of processes the scheduler does not manage (beyond their leases) */
  unmanaged_mb: number;
  unmanaged_processes?: IUnmanagedProcess[];
  /** id of the exclusive run or lease holding the device */
  exclusive: string | null;
  runs?: ILedgerRun[];
  leases?: ILedgerLease[];
  /** shared models holding VRAM here, or waiting to */
  models?: ILedgerModel[];
  /** on a host shared through a host ledger: the other users' grants here, by user name only (free_mb is net of them) */
  users?: ILedgerUser[];
}

export interface ILedgerLease {
  id: string;
  /** what the lease holds on this GPU (all usable VRAM when exclusive) */
  vram_mb: number;
  pid: number | null;
  label: string;
  kernel_id: string | null;
  session_path: string | null;
  /** what its process uses on this GPU now */
  observed_mb: number;
  /** observed beyond the lease: charged as unmanaged */
  over_lease_mb: number;
}

export interface ILedgerModel {
  name: string;
  vram_mb: number;
  /** held: the ledger holds its VRAM (admitted, loading or loaded); unloading: its host is being stopped for a waiting job (it holds its VRAM until it is gone); waiting: its load waits for room */
  state: string;
  /** since a caller last used it (0 while in use); null while waiting */
  idle_s: number | null;
  /** unloaded for a waiting job once idle this long; null: never */
  idle_unload_s: number | null;
  /** why its load waits (waiting only) */
  why: IWhy | null;
}

export interface ILedgerRun {
  id: string;
  marginal_vram_mb: number;
}

/** Another user's grants on a device of a host shared through a host ledger: by user name only. */
export interface ILedgerUser {
  user: string;
  /** VRAM their grants hold on this device (not in allocated_mb) */
  allocated_mb: number;
  /** their leases holding it */
  leases: number;
  /** their runs holding it */
  runs: number;
  /** their servers' shared models holding it */
  models: number;
}

/** one entry per token: the echoed prompt's, then the generated ones */
export interface ILegacyLogprobs {
  tokens: string[];
  token_logprobs: (number | null)[];
  top_logprobs: { [key: string]: number } | null[];
  text_offset: number[];
}

export interface IMetricDelta {
  /** mean paired difference against the baseline; null without pairs */
  mean: number | null;
  /** 95 % Student t interval of that mean; null below 2 pairs */
  ci95: number[] | null;
  /** episode indices both runs have */
  paired: number;
}

export interface IMetricStat {
  /** over the episodes where the metric is a finite number */
  mean: number | null;
  /** sample standard deviation / sqrt(count); null below 2 episodes */
  stderr: number | null;
  count: number;
}

/** ``POST /evalsched/models/{name}/connect``: where a kernel reaches a shared model. */
export interface IModelConnection {
  name: string;
  /** the model's URL, as runs get it in shared_urls.json */
  url: string;
}

export interface IModelInfo {
  name: string;
  /** not_loaded, loading, loaded or failed */
  state: string;
  device: string | null;
  vram_mb: number;
  requests: number;
  batches: number;
  mean_batch_size: number;
  load_count: number;
  /** {type, message}: why the host or the model failed */
  error: { [key: string]: unknown } | null;
  /** the path of the host's stderr log, kept after it dies */
  log: string | null;
  /** inputs served (a request may carry several) */
  inputs: number;
  failed_requests: number;
  /** batches per batch size */
  batch_sizes?: { [key: string]: number };
  /** mean time of a batch's forward pass */
  mean_batch_ms: number;
  /** the model's configured batch limit */
  max_batch_size: number;
  /** how long a batch waits to fill */
  max_wait_ms: number;
  /** how long the last load took */
  load_seconds: number | null;
  /** the model host's process */
  pid: number | null;
  /** times its host was started again */
  restarts: number;
  /** how long before a dead host may be started again (back-off) */
  held_s: number;
  /** the OpenAI-compatible base URL of the shared models (<server>/evalsched/v1); the model's id there is its name */
  endpoint: string | null;
  /** prompt tokens its host has read (API requests and plain calls) */
  prompt_tokens: number;
  /** tokens its host has generated */
  completion_tokens: number;
  /** prompt and generated tokens per second over the last 60 s (or since the load, if later) */
  tokens_per_s: number;
  /** prompt and generated tokens per second since the model loaded */
  tokens_per_s_since_load: number;
  /** when a caller last sent a request or got an answer (UTC, ISO 8601) */
  last_used_at: string | null;
}

export interface IModelList {
  models: IModelInfo[];
}

/** What a run used, as observed while it ran: peaks only (they never go down). */
export interface IObserved {
  /** per GPU index (NVML order) */
  peak_vram_mb?: { [key: string]: number };
  /** host memory at its peak: the run's memory cgroup peak where there is one (page cache it caused included, as the limit counts it), else the highest sampled RSS of its processes */
  peak_rss_mb: number | null;
  /** where the VRAM figures come from */
  source: 'nvml' | 'virtual';
}

export interface IOpenAIError {
  error: {
    message: string;
    type: string;
    code: string | null;
    param: string | null;
  };
}

export interface IOpenAIModel {
  id: string;
  object: 'model';
  created: number;
  owned_by: string;
}

export interface IOpenAIModelList {
  object: 'list';
  data: IOpenAIModel[];
}

export interface IOpenAIUsage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
}

export interface IPrimaryServer {
  url: string;
  pid: number;
  hostname: string;
  runs_dir: string;
  since: number;
}

export interface IProgress {
  done: number;
  total: number;
}

export interface IQueueView {
  /** the server that schedules for this host */
  primary: IPrimaryServer | null;
  /** in admission order; the first `limit` when the request gave one */
  queued: IRunRecord[];
  /** how many runs are queued, listed or not */
  queued_total: number;
  running: IRunRecord[];
  ledger: ILedger;
  /** live leases: granted, then queued in order */
  leases?: ILeaseRecord[];
}

/** A run's cancel answered: its record, and whether the run still ends. */
export interface IRunCancelAnswer {
  id: string;
  name: string;
  state: 'queued' | 'running' | 'succeeded' | 'failed' | 'cancelled' | 'aborted';
  /** a reason code, then an optional sentence after ': ' */
  reason: string | null;
  /** what it waits for, as data (its reason is derived from it); null when nothing is pending */
  why: IWhy | null;
  priority: 'high' | 'normal' | 'low';
  submitted_at: string;
  started_at: string | null;
  finished_at: string | null;
  pid: number | null;
  /** GPU indices (NVML order) */
  devices?: number[];
  /** as Popen's returncode: negative for a signal */
  exit_code: number | null;
  progress?: IProgress;
  marginal_vram_mb: number;
  depends_on?: string[];
  gpus: number;
  cpus: number;
  exclusive_gpu: boolean;
  models?: string[];
  timeout_s: number | null;
  executor: 'local' | 'slurm';
  /** submission counter: the queue's order, also after a restart */
  seq: number;
  /** the run process's start time (psutil create_time) */
  pid_create_time: number | null;
  run_dir: string;
  /** the latest aggregates of summary.json */
  metrics?: { [key: string]: unknown };
  slurm_job_id: string | null;
  slurm_state: string | null;
  /** the Idempotency-Key header of the submission; for a sweep's run '<key>#<i> <n>:<digest>' (its point, the sweep's number of points and their digest) */
  idempotency_key: string | null;
  /** the eval's entrypoint (eval.py:... for a cell's source) */
  entrypoint: string | null;
  /** sha256 of the spec's source, when it carries one */
  source_digest: string | null;
  /** where marginal_vram_mb came from: 'declared', or 'auto: ...' with the figures */
  marginal_vram_source: string;
  /** the host memory limit asked for (scheduling.memory_mb) */
  memory_mb: number | null;
  /** what the run was seen to use (null before anything was) */
  observed: IObserved | null;
  /** problems seen while it ran, each starting with a code (over_vram: ...) */
  warnings?: string[];
  /** 1 for the first attempt; resumes, retries and preemptions add one */
  attempt: number;
  /** times the run was preempted (stopped for a higher lane, resumed later) */
  preemptions: number;
  /** scheduling.preemptible, defaults filled in */
  preemptible: boolean;
  /** automatic retries allowed (the spec's retries) */
  retries: number;
  /** automatic retries made (a resume through the API starts again at 0) */
  retries_used: number;
  /** when a retry waiting out its back-off is admitted again */
  retry_at: string | null;
  /** the run does not die with the server */
  detach: boolean;
  /** how its current attempt started: forked from a zygote ('warm') or a fresh interpreter */
  start: 'warm' | 'cold' | null;
  /** which zygote forked it, or why it started cold */
  start_detail: string | null;
  /** the sweep the run belongs to (POST /evalsched/sweeps) */
  sweep_id: string | null;
  /** its sweep's name: the base of its runs' names '<base> [<point>]' (null outside a sweep) */
  sweep_name: string | null;
  /** the parameters its sweep set for it (its params are the spec's updated with them) */
  sweep_point: { [key: string]: unknown } | null;
  /** how each earlier attempt ended */
  history?: IAttemptEnd[];
  /** the cancel is under way: the run was signalled (or scancel'd) and ends cancelled when its process does; false when it ended already (cancelled at once, or before the cancel) */
  cancel_requested: boolean;
}

export interface IRunDetail {
  id: string;
  name: string;
  state: 'queued' | 'running' | 'succeeded' | 'failed' | 'cancelled' | 'aborted';
  /** a reason code, then an optional sentence after ': ' */
  reason: string | null;
  /** what it waits for, as data (its reason is derived from it); null when nothing is pending */
  why: IWhy | null;
  priority: 'high' | 'normal' | 'low';
  submitted_at: string;
  started_at: string | null;
  finished_at: string | null;
  pid: number | null;
  /** GPU indices (NVML order) */
  devices?: number[];
  /** as Popen's returncode: negative for a signal */
  exit_code: number | null;
  progress?: IProgress;
  marginal_vram_mb: number;
  depends_on?: string[];
  gpus: number;
  cpus: number;
  exclusive_gpu: boolean;
  models?: string[];
  timeout_s: number | null;
  executor: 'local' | 'slurm';
  /** submission counter: the queue's order, also after a restart */
  seq: number;
  /** the run process's start time (psutil create_time) */
  pid_create_time: number | null;
  run_dir: string;
  /** the latest aggregates of summary.json */
  metrics?: { [key: string]: unknown };
  slurm_job_id: string | null;
  slurm_state: string | null;
  /** the Idempotency-Key header of the submission; for a sweep's run '<key>#<i> <n>:<digest>' (its point, the sweep's number of points and their digest) */
  idempotency_key: string | null;
  /** the eval's entrypoint (eval.py:... for a cell's source) */
  entrypoint: string | null;
  /** sha256 of the spec's source, when it carries one */
  source_digest: string | null;
  /** where marginal_vram_mb came from: 'declared', or 'auto: ...' with the figures */
  marginal_vram_source: string;
  /** the host memory limit asked for (scheduling.memory_mb) */
  memory_mb: number | null;
  /** what the run was seen to use (null before anything was) */
  observed: IObserved | null;
  /** problems seen while it ran, each starting with a code (over_vram: ...) */
  warnings?: string[];
  /** 1 for the first attempt; resumes, retries and preemptions add one */
  attempt: number;
  /** times the run was preempted (stopped for a higher lane, resumed later) */
  preemptions: number;
  /** scheduling.preemptible, defaults filled in */
  preemptible: boolean;
  /** automatic retries allowed (the spec's retries) */
  retries: number;
  /** automatic retries made (a resume through the API starts again at 0) */
  retries_used: number;
  /** when a retry waiting out its back-off is admitted again */
  retry_at: string | null;
  /** the run does not die with the server */
  detach: boolean;
  /** how its current attempt started: forked from a zygote ('warm') or a fresh interpreter */
  start: 'warm' | 'cold' | null;
  /** which zygote forked it, or why it started cold */
  start_detail: string | null;
  /** the sweep the run belongs to (POST /evalsched/sweeps) */
  sweep_id: string | null;
  /** its sweep's name: the base of its runs' names '<base> [<point>]' (null outside a sweep) */
  sweep_name: string | null;
  /** the parameters its sweep set for it (its params are the spec's updated with them) */
  sweep_point: { [key: string]: unknown } | null;
  /** how each earlier attempt ended */
  history?: IAttemptEnd[];
  summary: { [key: string]: unknown } | null;
  /** why summary.json could not be read, when it exists but cannot */
  summary_error: string | null;
}

export interface IRunList {
  runs: IRunRecord[];
  total: number;
}

/**
 * The run record: REST answers, events and ``job.json`` share it. Every field the server
 * sends is declared here (a test checks); unknown fields in an old ``job.json`` are dropped.
 */
export interface IRunRecord {
  id: string;
  name: string;
  state: 'queued' | 'running' | 'succeeded' | 'failed' | 'cancelled' | 'aborted';
  /** a reason code, then an optional sentence after ': ' */
  reason: string | null;
  /** what it waits for, as data (its reason is derived from it); null when nothing is pending */
  why: IWhy | null;
  priority: 'high' | 'normal' | 'low';
  submitted_at: string;
  started_at: string | null;
  finished_at: string | null;
  pid: number | null;
  /** GPU indices (NVML order) */
  devices?: number[];
  /** as Popen's returncode: negative for a signal */
  exit_code: number | null;
  progress?: IProgress;
  marginal_vram_mb: number;
  depends_on?: string[];
  gpus: number;
  cpus: number;
  exclusive_gpu: boolean;
  models?: string[];
  timeout_s: number | null;
  executor: 'local' | 'slurm';
  /** submission counter: the queue's order, also after a restart */
  seq: number;
  /** the run process's start time (psutil create_time) */
  pid_create_time: number | null;
  run_dir: string;
  /** the latest aggregates of summary.json */
  metrics?: { [key: string]: unknown };
  slurm_job_id: string | null;
  slurm_state: string | null;
  /** the Idempotency-Key header of the submission; for a sweep's run '<key>#<i> <n>:<digest>' (its point, the sweep's number of points and their digest) */
  idempotency_key: string | null;
  /** the eval's entrypoint (eval.py:... for a cell's source) */
  entrypoint: string | null;
  /** sha256 of the spec's source, when it carries one */
  source_digest: string | null;
  /** where marginal_vram_mb came from: 'declared', or 'auto: ...' with the figures */
  marginal_vram_source: string;
  /** the host memory limit asked for (scheduling.memory_mb) */
  memory_mb: number | null;
  /** what the run was seen to use (null before anything was) */
  observed: IObserved | null;
  /** problems seen while it ran, each starting with a code (over_vram: ...) */
  warnings?: string[];
  /** 1 for the first attempt; resumes, retries and preemptions add one */
  attempt: number;
  /** times the run was preempted (stopped for a higher lane, resumed later) */
  preemptions: number;
  /** scheduling.preemptible, defaults filled in */
  preemptible: boolean;
  /** automatic retries allowed (the spec's retries) */
  retries: number;
  /** automatic retries made (a resume through the API starts again at 0) */
  retries_used: number;
  /** when a retry waiting out its back-off is admitted again */
  retry_at: string | null;
  /** the run does not die with the server */
  detach: boolean;
  /** how its current attempt started: forked from a zygote ('warm') or a fresh interpreter */
  start: 'warm' | 'cold' | null;
  /** which zygote forked it, or why it started cold */
  start_detail: string | null;
  /** the sweep the run belongs to (POST /evalsched/sweeps) */
  sweep_id: string | null;
  /** its sweep's name: the base of its runs' names '<base> [<point>]' (null outside a sweep) */
  sweep_name: string | null;
  /** the parameters its sweep set for it (its params are the spec's updated with them) */
  sweep_point: { [key: string]: unknown } | null;
  /** how each earlier attempt ended */
  history?: IAttemptEnd[];
}

/** What a run asks of the host. ``marginal_vram_mb`` is per GPU, on top of the shared models. */
export interface IScheduling {
  /** VRAM added per GPU, in MB; 'auto': the highest observed peak of earlier succeeded runs of the same eval, plus a margin */
  marginal_vram_mb?: number | 'auto';
  /** GPUs needed when the run uses VRAM or is exclusive */
  gpus?: number;
  /** nothing else may run on the run's GPUs */
  exclusive_gpu?: boolean;
  priority?: 'high' | 'normal' | 'low';
  /** CPU slots the run takes */
  cpus?: number;
  /** host memory limit of the run (its cgroup), in MB */
  memory_mb?: number | null;
  /** a waiting job of a higher lane may stop it at an episode boundary (it resumes later); default: true in the low lane, false otherwise */
  preemptible?: boolean | null;
}

/**
 * ``GET /evalsched/status``: this server's own view. The fields from ``runs_dir`` on are
 * sent by the server that schedules the runs directory (the primary) only.
 */
export interface IServerStatus {
  version: string;
  role: 'primary' | 'secondary' | 'unavailable';
  pid: number;
  /** the server that schedules for this runs directory */
  primary: IPrimaryServer | null;
  /** why no primary can answer, when none can */
  error: string | null;
  runs_dir: string | null;
  /** queued, running and total runs, and the active runs of each executor outside the ledger */
  counts: { [key: string]: number } | null;
  /** recovery has read the runs directory (until then run endpoints answer 503) */
  started: boolean | null;
  /** the cgroup mode in force */
  cgroups: { [key: string]: unknown } | null;
  /** the zygotes, or why warm starts are refused */
  warm_start: { [key: string]: unknown } | null;
  enforce_vram: 'off' | 'warn' | 'kill' | null;
  /** nvml, virtual, or the configured probe's */
  gpu_source: string | null;
  /** the host ledger this server is a tenant of (EvalSchedApp.host_ledger), when set */
  host_ledger: IHostLedgerStatus | null;
  /** run directories that cannot be used */
  broken_runs?: IBrokenRun[];
}

/**
 * A sweep's cancel answered: its view (``SweepView``), each run with ``cancel_requested``, and
 * how many still end.
 */
export interface ISweepCancelAnswer {
  id: string;
  runs: IRunCancelAnswer[];
  /** runs per state */
  counts?: { [key: string]: number };
  /** how many of its runs were signalled (or scancel'd) and have not ended yet: each ends cancelled when its process does (they show as running until then); 0 when every run ended */
  still_ending: number;
}

export interface ISweepCreated {
  id: string;
  runs: IRunRecord[];
}

export interface ISweepList {
  sweeps: ISweepSummary[];
}

/** ``POST /evalsched/sweeps``: a spec plus the points to run it at. */
export interface ISweepRequest {
  name?: string | null;
  /** pkg.module:function or path/file.py:function */
  entrypoint?: string | null;
  /** source of eval.py */
  source?: string | null;
  episodes?: number;
  params?: { [key: string]: unknown };
  workers?: number;
  seed?: number;
  models?: string[];
  env?: { [key: string]: string };
  cwd?: string | null;
  timeout_s?: number | null;
  depends_on?: string[];
  scheduling?: IScheduling;
  /** where the run executes: this host's ledger ('local') or SLURM; default: the server's */
  executor?: 'local' | 'slurm' | null;
  /** automatic resumes after a failure named in retry_on */
  retries?: number;
  /** the reason codes of failures that are retried: exception, exit_code, signal, oom, timeout, over_vram, model_unavailable */
  retry_on?: string[];
  /** the run does not die with the server; a restarted server re-attaches it */
  detach?: boolean;
  /** start the run in a fresh interpreter, never forked from a warm zygote */
  fresh_interpreter?: boolean;
  /** a grid {"<param>": [values, ...]} (every combination) or a list of points [{"<param>": value, ...}]; each point updates the spec's params for one run */
  sweep: unknown;
}

export interface ISweepSummary {
  id: string;
  /** the name of its first run */
  name: string | null;
  runs: number;
  counts: { [key: string]: number };
  submitted_at: string | null;
  seq: number;
}

export interface ISweepView {
  id: string;
  runs: IRunRecord[];
  /** runs per state */
  counts?: { [key: string]: number };
}

export interface IUnmanagedProcess {
  pid: number;
  gpu: number;
  used_mb: number;
  name: string;
  /** the notebook kernel this process is (or runs under) */
  kernel_id: string | null;
  /** that kernel's notebook */
  session_path: string | null;
  /** the lease that covers it: charged max(lease, observed) */
  lease_id: string | null;
  /** on a host shared through a host ledger: the user whose process it is (another user's carries nothing more than pid, gpu, used_mb and user) */
  user: string | null;
}

/** A pending reason as data (contract.Why): the record's ``reason`` is derived from it. */
export interface IWhy {
  /** the reason code (waiting_vram, reserved_for, preempted_by, ...) */
  code: string;
  /** the code's argument: reserved_for:<arg> */
  arg: string | null;
  /** the human sentence after ': ' */
  detail: string | null;
  /** what stands in the way, largest first */
  holders: IHolder[];
}
