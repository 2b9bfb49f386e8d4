"""The local launcher's rendezvous (rltrain.launch.local.OneMachineRendezvous): a store at a port the
OS picked, which a rank reaches as torchrun's ranks reach the agent's store (every 2-rank run of the
suite launches through it)."""

from __future__ import annotations

import datetime

from torch.distributed import TCPStore

from rltrain.launch.local import OneMachineRendezvous


def test_the_ranks_reach_the_agents_store_at_the_port_it_names():
    rendezvous = OneMachineRendezvous()
    info = rendezvous.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1) and rendezvous.use_agent_store
    port = info.bootstrap_store_info.master_port
    assert info.bootstrap_store_info.master_addr == "127.0.0.1" and port > 0
    assert rendezvous.next_rendezvous().bootstrap_store_info.master_port == port  # one store per launch
    rank = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    rank.set("from-a-rank", "1")
    assert info.store.num_keys() >= 1 and rank.get("from-a-rank") == b"1"
    assert OneMachineRendezvous().get_run_id() != rendezvous.get_run_id()
    assert not rendezvous.is_closed()
    rendezvous.set_closed()
    assert rendezvous.is_closed() and rendezvous.shutdown()
