"""Train a bundled model as a pipeline over several processes (one stage per rank), on the CPU.

    torchrun --standalone --nproc-per-node 2 examples/train_distributed.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 examples/train_distributed.py \
        --model vgg --batch 64 --steps 6 --timeline step.png

Every rank runs this same script: each builds the model on the meta device (shapes, no
storage), fxpipe.compile makes only that rank's stage real on its device, and pipe.step(x, y)
runs the schedule across the ranks and returns the loss on all of them. `--real` builds the
whole model on every rank instead (as most scripts written for one process do).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

import fxpipe
from fxpipe.models import bundled

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="resnet", choices=["resnet", "vgg", "gpt", "mlp"])
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--micro-batches", type=int, default=4)
parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--real", action="store_true", help="build the whole model on every rank")
parser.add_argument("--partitioner", help="default: the plan's (balanced when units are timed)")
parser.add_argument("--timeline", metavar="PNG",
                    help="after training, calibrate (fxpipe.calibrate), print pipe.report() "
                         "and draw the last step's measured and predicted timelines (needs "
                         "matplotlib)")
args = parser.parse_args()

torch.set_num_threads(1)  # one core per rank; more would oversubscribe a small machine
torch.manual_seed(0)  # every rank builds the same model and reads the same data
spec = bundled(args.model)
with torch.device("cpu" if args.real else "meta"):
    model = spec.build()  # on meta: each stage starts from its modules' reset_parameters()
data = torch.Generator().manual_seed(0)
x, y = spec.batch(args.batch, data)

plan = fxpipe.Plan(
    stages=int(os.environ.get("WORLD_SIZE", "1")),  # one stage per rank
    micro_batches=args.micro_batches, schedule=args.schedule, loss_fn=spec.loss_fn,
    partitioner=args.partitioner,
)
pipe = fxpipe.compile(model, plan, example_inputs=(x,), example_target=y)  # y: the loss timed too
rank = dist.get_rank()
if rank == 0:
    print(pipe)
held = sum(p.numel() for p in pipe.parameters())  # this rank's stage
real = sum(p.numel() for p in {id(p): p for p in model.parameters() if not p.is_meta}.values())
print(f"rank {rank}: stage {rank} holds {held:,} of the model's "
      f"{sum(p.numel() for p in model.parameters()):,} parameters; {real:,} have storage here")
optimizer = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)  # this rank's stage

times = []
for step in range(args.steps):
    start = time.perf_counter()
    optimizer.zero_grad()
    loss = pipe.step(x, y)
    optimizer.step()
    times.append(time.perf_counter() - start)
    if rank == 0:
        print(f"step {step}: loss {loss.item():.4f}  ({times[-1] * 1e3:.1f} ms)")

median = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
if rank == 0:
    print(f"throughput: {args.batch / median:.1f} samples/s (median step {median * 1e3:.1f} ms "
          f"over steps 1..{args.steps - 1})")
if args.timeline:  # every rank takes part: the ranks time together and exchange their traces
    # what each stage's actions take in real steps, beyond the units' timed costs
    calibration = fxpipe.calibrate(pipe, x, target=y)  # leaves the weights and gradients
    pipe.report(calibration=calibration)
    pipe.save_timeline(args.timeline, calibration=calibration)
state = fxpipe.gather_state_dict(pipe)  # the whole model's state dict, on rank 0
if rank == 0:
    spec.build().load_state_dict(state)
    print(f"gathered {len(state)} entries; they load into a plain {type(model).__name__}")
fxpipe.shutdown()  # every rank is done communicating before any tears gloo down
