"""What every stage and job uses, and nothing that knows a particular stage: the stage contract and its manifests,
storage, workdir paths, outputs and kept parts, input identity, the console and progress lines, redaction, the
workdir lock, config field checks."""
