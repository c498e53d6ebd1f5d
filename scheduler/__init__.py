"""Request scheduling and KV block management for jaxllm: plain Python over integers."""

from scheduler.block_pool import NULL_BLOCK_ID, BlockPool, KVCacheBlock, hash_block_tokens
from scheduler.kv_cache_manager import KVCacheManager, prompt_blocks_needed
from scheduler.output import FinishAfter, RequestResult, ScheduledRequest, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler, SchedulerConfig, check_stop

__all__ = [
    "NULL_BLOCK_ID",
    "BlockPool",
    "FinishAfter",
    "KVCacheBlock",
    "KVCacheManager",
    "Request",
    "RequestResult",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "check_stop",
    "hash_block_tokens",
    "prompt_blocks_needed",
]
