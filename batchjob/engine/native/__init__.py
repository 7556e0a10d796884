"""batchjob's own continuous-batching engine (`engine=native` / `engine=native_sync`)."""
