"""What the tests share: launching real ranks (launch), reference trainings (baseline, parity), corpora, tiny model
folders (models, moe_models), two hosts on one machine (twohosts), readers of tracker files, DeepSpeed's own
verdicts. Scripts that the tests start as processes (DeepSpeed ranks, fresh interpreters) are in tests/drivers/;
no test module imports from another test module."""
