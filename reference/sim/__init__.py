"""Simulation without a model: synthetic request traces shaped like the paper's datasets, and a
simulator that replays them over contiguous or paged allocation to account for every slot
(token states, reservations, fragmentation) — the paper's Figure 2 and the sharing savings."""
