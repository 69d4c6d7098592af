"""`trainfast tune`: time the candidate speed settings on this machine, keep the fastest
sound one, and cache the choice with the load it was measured under.

A measuring core (budget.Bench) times a setting within the tune's budget and records how many cores
other processes kept busy meanwhile; a strategy per device (search.CpuSearch, search.CudaSearch over the
shared search.Search) decides what to time next. The search is pruned, not exhaustive. (0) The
reference, fp32 in the plain layout: on a CPU at a batch whose step stays short
(start_batch_for) and with the rewrite passes (trainfast.models.rewrite) where they change the
model, on CUDA at the batch that fills the device (_fill: below it every setting is
launch-bound and they all look alike). (1) the opening: each precision (fp32, bf16; on CUDA also
tf32 and fp16) in channels_last; on a CPU timed together with the reference, their steps in
turns (together.py: one timing alone swings 10-30% there, and the machine's speed drifts),
beside the likeliest of them with the rewrites toggled and at twice the batch; (2) the winner
with the rewrites toggled (on CUDA added, on a CPU left out) where (1) did not time that, then
each precision in the plain layout; (3) batch sizes, powers of two, with the winner so far,
until memory runs out or two doublings in a row are slower, then the rewrites once more at
the new batch; (4) CPU threads, if torch uses fewer than the physical cores; (5) a final: the
fastest few and the winner's neighbours timed round-robin twice more (on a CPU each round
together, in turns), so that a slow spell of a shared machine falls on all of them; the best median wins, so that one lucky timing does not;
(6) torch.compile of the winner (its compile time reported apart; on CUDA with CUDA graphs).

A candidate counts only if its loss on the same first batch, from the same weights, is finite
and within 5% of fp32's. Each timing runs at least `steps` steps and at least `min_seconds` of
them, issued back to back and synchronised once, as training issues them. On CUDA the trials
use cudnn.benchmark and a fused SGD, as fit does. Where other processes hold a CPU's cores,
the tune also times half the threads (whether they yield their cores is not in their CPU
share), says so, and does not cache its choice as the
machine's (a busy tune once chose batch 4 and a quiet run reused it at a quarter of the speed).


Rooms: measure (timing one candidate, the loss check), together (several in turns), budget (the bound, the measuring core, a
short run's quick timing), search (the strategies), result (Trial, TuneResult, the batch rules
fit reads), tuner (tune() and its cache).
"""

from trainfast.tuning.budget import COMPILE_GUESS_S, SHORT_GAIN, Bench, too_short
from trainfast.tuning.measure import (LOSS_TOLERANCE, MIN_SECONDS, loss_matches, measure_trial, start_batch_for,
                                      warm_forward_s)
from trainfast.tuning.result import (BATCH_GAIN, MIN_STEPS_PER_EPOCH, Trial, TuneResult, data_max_batch,
                                     fastest_by_batch, more_steps_unless_faster)
from trainfast.tuning.search import MAX_BATCH, CpuSearch, CudaSearch
from trainfast.tuning.tuner import STANDALONE_S, forget, tune

__all__ = ["BATCH_GAIN", "COMPILE_GUESS_S", "LOSS_TOLERANCE", "MAX_BATCH", "MIN_SECONDS", "MIN_STEPS_PER_EPOCH",
           "SHORT_GAIN", "STANDALONE_S", "Bench", "CpuSearch", "CudaSearch", "Trial", "TuneResult",
           "data_max_batch", "fastest_by_batch", "forget", "loss_matches", "measure_trial",
           "more_steps_unless_faster", "start_batch_for", "too_short", "tune", "warm_forward_s"]

tune.__module__ = __name__  # the public path (trainfast.tuning.tune), as users and reprs name it
