"""What the multi-process rungs share (7: pipeline, 10: tensor parallel, 11: disaggregation):
``comm.py`` (messages between ranks, every wait bounded; ``WorkerError`` when a rank is lost),
``launcher.py`` (spawning and watching worker processes; torchrun's environment) and
``timeline.py`` (the spans each rank records). Nothing here knows what a rank computes."""
