"""What ranks know of each other: host shared memory (:mod:`~dbo.peers.hostboard`), arrival
counters (:mod:`~dbo.peers.arrival`), the vote through shared memory
(:mod:`~dbo.peers.hostvote`), the timeout on every wait (:mod:`~dbo.peers.watchdog`), the small
collectives (:mod:`~dbo.peers.collectives`: group size, all-reduce MAX), collective work that
gloo has freed before its wait returns (:mod:`~dbo.peers.work`) and a program's process group
from torchrun's environment to its teardown (:mod:`~dbo.peers.process_group`)."""
