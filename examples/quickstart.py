"""Compile a model into a 2-stage pipeline, look at it, and train it with an ordinary loop.

    python examples/quickstart.py
"""

import torch
import torch.nn.functional as F

import fxpipe
from fxpipe.models import ResNet

torch.manual_seed(0)
model = ResNet()
x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))

plan = fxpipe.Plan(stages=2, micro_batches=4, schedule="1f1b", loss_fn=F.cross_entropy)
pipe = fxpipe.compile(model, plan, example_inputs=(x,), example_target=y)  # y: the loss timed too
print(pipe)  # the stage table: units, parameters, predicted times, memory, boundary tensors
pipe.print_graph()  # the rewritten graph: stage, hook, send and recv nodes
print(pipe.passes)  # the compiler passes, each with its time and result
print(pipe.predicted_timeline().ascii())  # what the event simulator expects one step to look like

optimizer = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)  # the model's parameters
for step in range(5):
    optimizer.zero_grad()
    loss = pipe.step(x, y)  # the whole 1F1B schedule: forward and backward on every stage
    optimizer.step()
    print(f"step {step}: loss {loss.item():.4f}")

# The drop-in way works too: pipe(x) is pipelined, loss.backward() runs the pipelined backward.
loss = F.cross_entropy(pipe(x), y)
loss.backward()
pipe.save_trace("quickstart_trace.json")  # measured and predicted timelines for ui.perfetto.dev
torch.save(pipe.state_dict(), "quickstart.pt")  # the plain model's keys: ResNet().load_state_dict
