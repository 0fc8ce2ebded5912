"""The door dimension of the exactness matrix: each framework's own step, on unequal batches, equals one process.

A door is a framework OmniLearn plugs into: Hugging Face's ``Trainer``
(``OmniLearnTrainer``), a custom ``accelerate`` loop, Lightning's ``Trainer``
(``OmniLearnStrategy``), Lightning Fabric (``OmniLearnFabricStrategy``), Keras
``fit`` (``ol.fit``) and the TensorFlow custom loop (``ol.wrap``/``ol.step``).
A door shape (:data:`DOOR_SHAPES`, one line each) is one natural way of
writing a step in that framework: what the model returns (a tensor, a tuple
with the loss computed inside from ``labels=``, a ``ModelOutput``, a dict of
features, hidden states...), where the loss is made (``compute_loss``,
``training_step``, a compiled dict of losses, ``add_loss``...), and
accumulation. The code of each shape is in its door's runner, under the same
name (:mod:`exactness.door_hf`, :mod:`exactness.door_lightning`,
:mod:`exactness.door_tf`).

A cell is (door, shape, split): trained :data:`~exactness.matrix.STEPS`
steps of global batch :data:`~exactness.matrix.GLOBAL_BATCH` on the ranks
of its launch (:data:`LAUNCHES`), unequal from step 0
(``controller="static"`` with the split as the declared speeds,
``emulator="none"``), then compared with one plain process on the same
global batches: for the PyTorch doors the matrix's reference
(:func:`exactness.runner.reference`: ``exactness.models.Net``, SGD, the loss
form named by the row); for the TensorFlow doors what plain Keras does in
one process (``train_on_batch`` with the same ``compile``, or the TensorFlow
guide's ``GradientTape`` loop, which adds ``model.losses``). A cell passes at
a relative error of at most :data:`~exactness.matrix.EXACT_F64` (float64
everywhere: ``precision="64-true"`` for Lightning, ``floatx`` float64 for
Keras), with every rank's batches the split at every step; a row with
``refusal`` passes when every rank raised one line containing it. A row with
``known`` is a defect found by the matrix (what is wrong, measured): its
cells are ``xfail(strict=True)``, so fixing it turns them into failures that
ask for the row to be updated. A ``control`` row (one per launch: rank 0's
loss 1% too large) must come out inexact: the comparison can fail.

Each launch runs all its doors' cells in one set of rank processes, one
session after another (:mod:`exactness.door_torch`, :mod:`exactness.door_tf`).
Run: ``python -m pytest -q tests/exactness/test_doors.py`` (or ``tests/exactness``).
"""

from __future__ import annotations

from typing import NamedTuple


class DoorShape(NamedTuple):
    """One natural step shape of a door. ``reference``: the one-process reference's loss form (a name in
    ``exactness.models.LOSSES`` for the PyTorch doors, ``"keras"`` for the TensorFlow doors); ``accumulation``:
    micro-batches per step; ``refusal``: the cell must be refused, in one line containing this; ``known``: a
    defect the cell shows today (xfail, strict), with its numbers; ``control``: rank 0's loss scaled by 1.01,
    the cell must come out inexact (a weight 1% off shows at this split and step count)."""

    door: str
    shape: str
    reference: str = "mean"
    accumulation: int = 1
    refusal: str | None = None
    known: str | None = None
    control: bool = False


DOOR_SHAPES: tuple[DoorShape, ...] = (
    # Hugging Face Trainer (OmniLearnTrainer); the model is called as model(**batch), batch = {x, labels, idx}
    DoorShape("hf_trainer", "model_output"),  # a ModelOutput, its loss computed inside from labels=
    DoorShape("hf_trainer", "loss_tuple"),  # a (loss, logits) tuple
    DoorShape("hf_trainer", "hidden_states"),  # config.output_hidden_states=True: (loss, logits, hidden_states)
    DoorShape("hf_trainer", "compute_loss_penalty", "penalty"),  # a compute_loss override adds a penalty
    DoorShape("hf_trainer", "compute_loss_func"),  # a dict of features; Trainer(compute_loss_func=) over the items
    DoorShape("hf_trainer", "model_output_accumulated", accumulation=2),  # gradient_accumulation_steps=2
    DoorShape("hf_trainer", "control_off_by_1pct", control=True),  # compute_loss x 1.01 on rank 0
    # a custom accelerate loop with OmniLearn's lines (docs/huggingface.md)
    DoorShape("accelerate", "tensor"),  # the prediction; the loss outside
    DoorShape("accelerate", "model_output", accumulation=2),  # model(x, labels=t).loss, 2 micro-batches
    DoorShape("accelerate", "dict_aux", "aux"),  # a dict of features, plus the auxiliary loss the module kept
    # Lightning Trainer(strategy=OmniLearnStrategy(...)), precision="64-true"
    DoorShape("lightning", "loss_tensor"),  # training_step returns the loss
    DoorShape("lightning", "loss_dict"),  # training_step returns {"loss": ..., "logits": ...}
    DoorShape("lightning", "forward_tuple_aux", "aux"),  # forward returns (y, [h1, h]); + the auxiliary loss
    DoorShape("lightning", "forward_dict_accumulated", accumulation=2),  # forward returns a dict; 2 micro-batches
    DoorShape("lightning", "manual_optimization"),  # automatic_optimization=False: manual_backward, opt.step()
    DoorShape("lightning", "control_off_by_1pct", control=True),  # training_step's loss x 1.01 on rank 0
    # Lightning Fabric with OmniLearnFabricStrategy, fabric.backward(loss)
    DoorShape("fabric", "loss_tuple"),  # model(x, labels=t) returns (loss, y)
    DoorShape("fabric", "dict_aux", "aux"),  # a dict of features, plus the auxiliary loss
    DoorShape("fabric", "tensor_accumulated", accumulation=2),  # no_backward_sync on the first micro-batch
    # Keras fit through ol.fit (float64 Keras), against Keras' own train_on_batch
    DoorShape("keras_fit", "one_output", "keras"),  # a compiled loss
    DoorShape("keras_fit", "add_loss", "keras"),  # a layer's add_loss (an auxiliary loss, a per-sample mean)
    DoorShape("keras_fit", "kernel_regularizer", "keras"),  # an L2 kernel regularizer
    DoorShape("keras_fit", "dict_of_losses", "keras", refusal="ol.wrap"),  # 2 named outputs: the custom loop
    # 2 outputs, one compiled loss: refused (it trained on the mean of the outputs' losses, 3.9e-2 to 4.7e-1 from
    # Keras' own, silently, until 2026-12-07)
    DoorShape("keras_fit", "two_outputs_one_loss", "keras", refusal="output"),
    # the TensorFlow custom loop: ol.wrap(model, optimizer, loss), ol.data, ol.step; against a GradientTape loop
    DoorShape("tf_loop", "loss_object", "keras"),  # a Keras Loss object
    DoorShape("tf_loop", "dict_outputs", "keras"),  # a dict of 2 outputs, a callable loss over both
    # model_losses unset: refused (model.losses were dropped silently, 9e-4 to 2e-3 off, until 2026-12-07)
    DoorShape("tf_loop", "add_loss", "keras", refusal="model.losses"),
    DoorShape("tf_loop", "add_loss_added", "keras"),  # ol.wrap(..., model_losses=True): OmniLearn adds them
    DoorShape("tf_loop", "add_loss_flag_typo", "keras", refusal="model_losses='yes'"),  # neither True nor False
    DoorShape("tf_loop", "add_loss_in_callable", "keras"),  # the loss callable adds model.losses itself
    DoorShape("tf_loop", "control_off_by_1pct", "keras", control=True),  # the loss x 1.01 on worker 0
)

# The launches: one set of rank processes each, running its doors' cells in table order, and its splits
LAUNCHES: dict[str, tuple[str, ...]] = {"hf": ("hf_trainer", "accelerate"), "lightning": ("lightning", "fabric"),
                                        "tf": ("keras_fit", "tf_loop")}
SPLITS: dict[str, tuple[tuple[int, ...], ...]] = {"hf": ((12, 4), (2, 14)), "lightning": ((12, 4), (2, 14)),
                                                  "tf": ((12, 4), (3, 13))}


class DoorCell(NamedTuple):
    """A (door, shape, split) cell."""

    door: str
    shape: str
    split: tuple[int, ...]

    @property
    def id(self) -> str:
        return f"{self.door}-{self.shape}-{'/'.join(map(str, self.split))}"

    @property
    def row(self) -> DoorShape:
        return ROWS[self.door, self.shape]

    @property
    def launch(self) -> str:
        return next(name for name, doors in LAUNCHES.items() if self.door in doors)

    @property
    def world(self) -> int:
        return len(self.split)


ROWS: dict[tuple[str, str], DoorShape] = {(r.door, r.shape): r for r in DOOR_SHAPES}


def door_cells(launch: str | None = None) -> list[DoorCell]:
    """Every shape of every door on each split of its launch; a refused, known-defect or control row on the first
    split only (its outcome does not depend on the split). ``launch``: that launch's cells only."""
    cells = []
    for name, doors in LAUNCHES.items():
        if launch in (None, name):
            for row in DOOR_SHAPES:
                if row.door in doors:
                    splits = SPLITS[name][:1] if row.refusal or row.known or row.control else SPLITS[name]
                    cells += [DoorCell(row.door, row.shape, split) for split in splits]
    return cells
