import os
import sys

import torch

import gossipdl
from gossipdl.data import load_dataset, partition

rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int((sys.argv[3:] or [5550])[0])
addresses = [f"tcp://127.0.0.1:{port + i}" for i in range(world)]
torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the peers share the cores
data = load_dataset("digits")  # scikit-learn's bundled 8x8 digits, no download
mine = partition(data.y_train, world, "iid", seed=0)[rank]
x, y = torch.tensor(data.x_train[mine]).flatten(1), torch.tensor(data.y_train[mine])
torch.manual_seed(0)  # the same initial model on every peer
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
with gossipdl.Peer(model, opt, rank=rank, peers=addresses, topology="ring") as peer:
    for _ in range(300):
        batch = torch.randint(len(y), (32,))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        peer.step()  # local SGD step, then one gossip round with the ring neighbours
xt, yt = torch.tensor(data.x_test).flatten(1), torch.tensor(data.y_test)
print(f"peer {rank}: test accuracy {(model(xt).argmax(1) == yt).float().mean():.3f}")
