"""A rollout: a new cluster file applied one group at a time under the capacity floor. `plan` and `rules` are pure
(the plan, the step state machine), `record` is its etcd shape, `view` what its status says, `bake` the judge of a
step under traffic, `member_config` this member's files, `http` the canary, `executor` the etcd I/O and the
`NodeLayer` that carries the steps out.
"""
