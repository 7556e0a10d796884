"""batchjob's own continuous-batching engine (`engine=native` / `engine=native_sync`)."""

from batchjob.caches import use_kernel_cache

use_kernel_cache()
