"""Pictures and notebook tools, one job a module (the notebook that uses each in brackets).

Drawing (pure matplotlib, one palette and one memory legend, both in ``plots.py``):
  plots.py             every picture's building blocks: memory maps, charts over time (all)
  notebook_figures.py  each notebook's key figure, composed from plots.py (00-05)
  batch_figures.py     the static 4 x 8 batch frame by frame, the batch-size sweep (00-02)
  block_figures.py     block tables with their words, copy-on-write step by step, beams'
                       reference counts, the prefix cache (03)
  schedule_figures.py  chunked prefill riding with decodes, priorities, preemptions (03)
  lora_figures.py      which adapter each slot holds, step by step (13)
Widgets (ipywidgets classes that call the drawing functions):
  live_view.py         LiveMemoryView: KV memory while an engine runs, then a slider, and its
                       last frame as a picture for pages without a kernel (00-06, 08-11, 13)
  visualizer.py        FragmentationVisualizer: workload controls, every allocator (05)
  frames.py            FramePlayer: frames drawn off the event loop, no backlog after Stop (05)
The fragmentation visualizer's replays, no model needed (05):
  accounting.py        the kinds of slots, SimConfig, SimResult (a run's StepRecords)
  replay.py            simulate / compare: the real PagedEngine, computing nothing, under one
                       allocator of minillm/engines/r5_allocators/ or all of them
  traces.py            Trace, trace_from_run, record_paged_run, replay_trace: real runs replayed
Notebook set-up and the figures/ script:
  notebook.py          setup(), scratch_dir(), forward_seconds, comparison_table (00-05)
  figures.py           python -m minillm.viz.figures (make figures): writes figures/*.png
"""
