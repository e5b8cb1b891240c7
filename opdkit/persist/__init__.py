"""What a run keeps on disk, apart from the training step: the run directory (``rundir``: locks, resume,
``run.json``), the trainer state for resuming (``trainer_state``, written through ``tensor_files``), the published
HF checkpoints (``publish``: atomic exports in the background, retries, retention; ``weights_io``: safetensors
shards), their validation (``checkpoints``) and the filesystem helpers they share (``fsutil``: atomic writes,
locks, liveness). Importing the package imports none of them."""
