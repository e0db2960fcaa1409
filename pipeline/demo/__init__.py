"""The demo and what it is made of, apart from the library: ``distillq demo`` on the tiny pair (``tiny``), the real
pair (``real``), the vLLM student (``vllm_student``), two teachers (``teachers``) and a teacher of another tokenizer
(``crosstok_demo``); the tiny models and their arithmetic task
(``tinymodels``, ``pretrain``); the real pair and its task set (``realpair``, ``realtasks``); task accuracy and
answer log-likelihood (``taskeval``); and the example learner (``learner``: ``python -m pipeline.demo.learner``).

Nothing in the library (``pipeline.stages``, ``teacher``, ``rollout``, ``transport``, ``learner``, ``models``,
``serve``) imports this package; the CLI's ``demo`` and ``models`` commands do.
"""
