# Temporary diagnostic: does a second TORCH_CHECK failure from _C crash the process?
import torch
from vllm_petit_moe import _C
ids = torch.zeros(4, 2, dtype=torch.int64, device="cuda")
try:
    _C.expert_row_lists(ids, 4)
except RuntimeError as e:
    print("first error ok:", str(e)[:60], flush=True)
x = ids.int()
torch.cuda.synchronize()
print("ids.int() ok", flush=True)
try:
    _C.expert_row_lists(x, 513)
except RuntimeError as e:
    print("second error ok:", str(e)[:60], flush=True)
print("repro passed", flush=True)
