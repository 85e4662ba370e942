"""Checkpoints, from the disk up:

- `unpickle`: what a checkpoint's pickles may hold (data, never code);
- `tensor_io`: tensors written and read at the disk's speed, hashed while written;
- `store`: atomic, verified checkpoint folders on a shared directory;
- `engine`: DeepSpeed's checkpoint engine and the optimizer's swap files;
- `optimizer_state`: the optimizer state DeepSpeed's load leaves out, put back exactly;
- `universal`: a checkpoint as DeepSpeed's universal checkpoint, to resume across shapes;
- `mirror`: checkpoints copied to object storage.

The recipe's use of them is `spillway_runtime.training.checkpointing`.
"""
