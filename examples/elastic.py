"""Training that outlives a rank: the digits MLP on 4 processes, one SIGKILLed mid-run.

    pip install -e '.[mpi]' scikit-learn
    mpiexec -disable-auto-cleanup -n 4 sh -c 'trap "" USR1; python examples/elastic.py; exit $?'

(The shell lets the other ranks live when one dies: MPICH's mpiexec would
end them all; docs/api.md, "Going on after a failure".)

examples/numpy_mlp.py's synchronous SGD, run by collectives.elastic: the
parameters and the step live in an ArrayState, committed every
--commit-every steps. Rank --kill-rank kills itself with SIGKILL at step
--kill-step (drawn from --seed unless given; --kill-step -1: nobody dies).
The survivors' allreduce raises RankFailedError; elastic.run shrinks the
communicator to the 3 ranks left, rolls every survivor back to the last
commit, syncs it from the new rank 0 and calls train again, which now
splits each global batch 3 ways instead of 4. The global batch (a multiple
of 12) stays the same, so the run computes what an uninterrupted one does,
and ends on its accuracy; the steps since the last commit are done again.
"""

import argparse
import os
import signal

import numpy as np

import collectives
from collectives import elastic
from numpy_mlp import accuracy, digits, gradients, init_params


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=60, help="global batch size (a multiple of 12: 4, 3 and 2 ranks)")
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--commit-every", type=int, default=10, help="steps between commits")
    parser.add_argument("--kill-rank", type=int, default=None, help="the rank that dies (default: drawn from --seed)")
    parser.add_argument("--kill-step", type=int, default=None, help="the step it dies at (default: drawn; -1: none)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    comm = collectives.init(timeout=30)
    original = comm.rank
    x_train, y_train, x_test, y_test = digits()
    steps_per_epoch = len(y_train) // args.batch
    total = args.epochs * steps_per_epoch
    draw = np.random.default_rng(args.seed)
    kill_rank = int(draw.integers(comm.size)) if args.kill_rank is None else args.kill_rank
    kill_step = int(draw.integers(1, total)) if args.kill_step is None else args.kill_step

    w1, b1, w2, b2 = init_params(np.random.default_rng(original))   # run() starts every rank from rank 0's
    state = elastic.ArrayState(comm, w1=w1, b1=b1, w2=w2, b2=b2, step=0)
    params = [w1, b1, w2, b2]   # restored in place after a failure: these stay the state's arrays

    def report(state):
        if state.comm.rank == 0:
            print(f"a rank died: {state.comm.size} ranks go on from the commit at step {state.step} "
                  f"(old ranks {list(state.comm.old_ranks)})", flush=True)

    state.on_reset(report)

    def train(state):
        size, rank = state.comm.size, state.comm.rank
        local = args.batch // size
        while state.step < total:
            if original == kill_rank and state.step == kill_step:
                print(f"rank {original} dies at step {state.step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            epoch, i = divmod(state.step, steps_per_epoch)
            order = np.random.default_rng(epoch).permutation(len(y_train))   # the same on every rank
            batch = order[i * args.batch:(i + 1) * args.batch]
            mine = batch[rank * local:(rank + 1) * local]
            grads = gradients(params, x_train[mine], y_train[mine])
            state.comm.allreduce_many(grads, op="avg")
            for p, g in zip(params, grads):
                p -= args.lr * g
            state.step += 1
            if state.step % args.commit_every == 0 or state.step == total:
                state.commit()

    elastic.run(train, state)
    comm = state.comm
    flat = np.concatenate([p.reshape(-1) for p in params])
    gathered = comm.allgather(flat).reshape(comm.size, -1)
    same = all(np.array_equal(gathered[0].view(np.uint32), g.view(np.uint32)) for g in gathered)
    if comm.rank == 0:
        print(f"{comm.size} ranks finished {total} steps; test accuracy {accuracy(params, x_test, y_test):.4f}; "
              f"parameters bitwise identical: {same}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
