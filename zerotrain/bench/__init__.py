"""`zerotrain bench`: benchmark a cluster in batches of nodes and find the slow ones (docs/bench.md).

    split   node list -> hostfiles of K nodes        (split.py)
    run     every hostfile's job at once, timed out   (runner.py)
    report  throughput, verdicts, CSV, PNG, suspects  (report.py)
    comm    collective bandwidth, all nodes and pairs (comm.py)
"""
