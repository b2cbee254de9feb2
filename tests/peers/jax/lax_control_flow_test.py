# ruff: noqa
# Copyright 2018 The JAX Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     https://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

# Vendored from JAX 0.10.0 (github.com/jax-ml/jax, tag jax-v0.10.0, tests/
# lax_control_flow_test.py), Apache-2.0: see LICENSE in this folder. Trimmed for memox
# to the tests that run `lax.scan` (those whose name or body names `scan`, but for the
# `lax.associative_scan` ones) and the helpers they use; otherwise unchanged. conftest.py
# runs them with `memox.scan` as `lax.scan` (see README.md).


import collections
from functools import partial
import itertools
import math
import re
import unittest

from absl.testing import absltest
from absl.testing import parameterized

import numpy as np

import jax
from jax._src import core
from jax._src import config
from jax import lax
from jax import random
from jax._src import test_util as jtu
from jax._src.util import unzip2, split_list
from jax import checkpoint_policies
import jax.numpy as jnp  # scan tests use numpy
from jax._src import dispatch
from jax._src.lax import control_flow as lax_control_flow
from jax._src.interpreters import batching
from jax._src.interpreters import mlir

jax.config.parse_flags_with_absl()


# We wanted to try all scan tests with the scan partial evaluation rule that
# happens under jax.checkpoint, so we make a scan wrapper which
# wraps a jax.checkpoint around the computation.
def scan_with_new_checkpoint(f, *args, **kwargs):
  return jax.checkpoint(partial(lax.scan, f, **kwargs),
                        policy=checkpoint_policies.nothing_saveable)(*args)
def scan_with_new_checkpoint2(f, *args, **kwargs):
  return jax.checkpoint(partial(lax.scan, f, **kwargs),
                        policy=checkpoint_policies.everything_saveable)(*args)

SCAN_IMPLS_WITH_FOR = [
    (lax.scan, 'unroll1'),
    (partial(lax.scan, unroll=0), 'unroll0'),
    (partial(lax.scan, unroll=2), 'unroll2'),
    (scan_with_new_checkpoint , 'new_checkpoint'),
    (scan_with_new_checkpoint2, 'new_checkpoint2'),
]

def scan_reference(f, init, xs):
  carry = init
  ys = []
  for x in xs:
    (carry, y) = f(carry, x)
    ys.append(lax.reshape(y, (1,) + np.shape(y)))
  ys = lax.concatenate(ys, 0)
  return carry, ys


# A JAX primitive that triggers error when lowering on unintended platforms
prim_with_lowering_error = core.Primitive("__testing_prim_with_lowering_error")
prim_with_lowering_error.def_abstract_eval(lambda x_aval, **_: x_aval)
def prim_with_lowering_error_lowering(platform: str,
                                      ctx: mlir.LoweringRuleContext, x, *,
                                      only_on: str):
  if platform != only_on:
    raise ValueError(f"prim_with_lowering_error with only_on={only_on} lowered for {platform}")
  return mlir.hlo.SineOp(x).results
def prim_with_lowering_error_batch_rule(batched_args, batch_dims, **params):
  xs, = batched_args
  xs_bdim, = batch_dims
  return prim_with_lowering_error.bind(xs, **params), xs_bdim

batching.primitive_batchers[prim_with_lowering_error] = prim_with_lowering_error_batch_rule

mlir.register_lowering(
    prim_with_lowering_error,
    partial(prim_with_lowering_error_lowering, "cpu"),
    platform="cpu")
mlir.register_lowering(
    prim_with_lowering_error,
    partial(prim_with_lowering_error_lowering, "tpu"),
    platform="tpu")
prim_with_lowering_error.def_impl(partial(dispatch.apply_primitive,
                                          prim_with_lowering_error))


class LaxControlFlowTest(jtu.JaxTestCase):

  def setUp(self):
    super().setUp()
    lax_control_flow.common._dedup_consts.cache_clear()
    lax_control_flow.common._pad_constvars.cache_clear()

  def testCallableErrors(self):
    not_callable = 42
    with self.assertRaisesRegex(TypeError, "lax.fori_loop.*callable.*"):
      lax.fori_loop(0, 1, not_callable, 0)
    with self.assertRaisesRegex(TypeError, "lax.while_loop.*callable.*"):
      lax.while_loop(not_callable, not_callable, 0)
    with self.assertRaisesRegex(TypeError, "lax.switch:.*callable.*"):
      lax.switch(0, [not_callable])
    with self.assertRaisesRegex(TypeError, "lax.cond.*callable.*"):
      lax.cond(0, not_callable, not_callable)
    with self.assertRaisesRegex(TypeError, "lax.scan.*callable.*"):
      lax.scan(not_callable, 0, 1)
    with self.assertRaisesRegex(TypeError, "lax.associative_scan.*callable.*"):
      lax.associative_scan(not_callable, 0)

  def testForiLoopIssue8152(self):
    y = lax.fori_loop(lower=0, upper=0, body_fun=lambda x, i: x + i, init_val=1.)
    self.assertAllClose(y, 1., check_dtypes=False)

    # trivial fori_loop should work - even when jit is disabled
    with jax.disable_jit():
      y = lax.fori_loop(lower=0, upper=0, body_fun=lambda x, i: x + i, init_val=1.)
    self.assertAllClose(y, 1., check_dtypes=False)

    # scan with length 0 should work with jit, but raise an error without
    def should_raise_wo_jit():
      carry, out = lax.scan(lambda c, x: (c + x, x), 0., np.array([]))
      return carry
    self.assertAllClose(should_raise_wo_jit(), 0., check_dtypes=False)
    with jax.disable_jit():
      self.assertRaises(ValueError, should_raise_wo_jit)

  @parameterized.named_parameters(
      {"testcase_name": f"_{jit_scan=}_{jit_f=}_impl={scan_name}",
       "jit_scan": jit_scan, "jit_f": jit_f, "scan": scan_impl,
       "impl_name": scan_name}
      for jit_scan in [False, True]
      for jit_f in [False, True]
      for scan_impl, scan_name in SCAN_IMPLS_WITH_FOR)
  def testScanImpl(self, jit_scan, jit_f, scan, impl_name):
    rng = self.rng()

    d = rng.randn(2)
    def f(c, a):
      assert a.shape == (3,)
      assert c.shape == (4,)
      b = jnp.cos(jnp.sum(jnp.sin(a)) + jnp.sum(jnp.cos(c)) + jnp.sum(d))
      c = jnp.sin(c * b)
      assert b.shape == ()
      return c, b

    if jit_f:
      f = jax.jit(f)
    if jit_scan:
      scan = jax.jit(scan, static_argnums=(0,))

    as_ = rng.randn(5, 3)
    c = rng.randn(4)

    ans =                scan(f, c, as_)
    expected = scan_reference(f, c, as_)
    rtol = {np.float64: 1.4e-15}
    atol = {np.float64: 8e-15}
    if impl_name == "for":
      rtol[np.float32] = 8e-5
      atol[np.float32] = 3e-5
    self.assertAllClose(
        ans,
        expected,
        check_dtypes=False,
        rtol=rtol,
        atol=atol)

  @parameterized.named_parameters(
      {"testcase_name": f"_{jit_scan=}_{jit_f=}_impl={scan_name}",
       "jit_scan": jit_scan, "jit_f": jit_f, "scan": scan_impl}
      for jit_scan in [False, True]
      for jit_f in [False, True]
      for scan_impl, scan_name in SCAN_IMPLS_WITH_FOR)
  def testScanJVP(self, jit_scan, jit_f, scan):
    rng = self.rng()

    d = rng.randn(2)
    def f(c, a):
      assert a.shape == (3,)
      assert c.shape == (4,)
      b = jnp.cos(jnp.sum(jnp.sin(a)) + jnp.sum(jnp.cos(c)) + jnp.sum(d))
      c = jnp.sin(c * b)
      assert b.shape == ()
      return c, b

    if jit_f:
      f = jax.jit(f)
    if jit_scan:
      scan = jax.jit(scan, static_argnums=(0,))

    as_ = rng.randn(5, 3)
    c = rng.randn(4)

    ans = jax.jvp(     lambda c, as_:           scan(f, c, as_), (c, as_), (c, as_))
    expected = jax.jvp(lambda c, as_: scan_reference(f, c, as_), (c, as_), (c, as_))
    tol = {np.float64: 1e-12, np.float32: 1e-4}
    self.assertAllClose(ans, expected, check_dtypes=False, rtol=tol, atol=tol)

    jtu.check_grads(partial(scan, f), (c, as_), order=2, modes=["fwd"],
                    rtol={jnp.float32: 2e-1})

  @parameterized.named_parameters(
      {"testcase_name": f"_{jit_scan=}_{jit_f=}_impl={scan_name}",
       "jit_scan": jit_scan, "jit_f": jit_f, "scan": scan_impl}
      for jit_scan in [False, True]
      for jit_f in [False, True]
      for scan_impl, scan_name in SCAN_IMPLS_WITH_FOR)
  def testScanLinearize(self, jit_scan, jit_f, scan):
    rng = self.rng()

    d = rng.randn(2)
    def f(c, a):
      assert a.shape == (3,)
      assert c.shape == (4,)
      b = jnp.cos(jnp.sum(jnp.sin(a)) + jnp.sum(jnp.cos(c)) + jnp.sum(d))
      c = jnp.sin(c * b)
      assert b.shape == ()
      return c, b

    if jit_f:
      f = jax.jit(f)
    if jit_scan:
      scan = jax.jit(scan, static_argnums=(0,))

    as_ = rng.randn(5, 3)
    c = rng.randn(4)

    if scan is scan_with_new_checkpoint2:
      atol = {}
      rtol = {np.float64: 1e-12, np.float32: 1e-4}
    else:
      atol = {np.float64: 1e-14}
      rtol = {np.float64: 1e-14, np.float32: 1e-4}

    ans = jax.linearize(lambda c, as_:                scan(f, c, as_), c, as_)[1](c, as_)
    expected = jax.linearize(lambda c, as_: scan_reference(f, c, as_), c, as_)[1](c, as_)
    self.assertAllClose(
        ans, expected, check_dtypes=False, atol=atol, rtol=rtol
    )

  @parameterized.named_parameters(
      {"testcase_name": f"_{jit_scan=}_{jit_f=}_impl={scan_name}",
       "jit_scan": jit_scan, "jit_f": jit_f, "scan": scan_impl}
      for jit_scan in [False, True]
      for jit_f in [False, True]
      for scan_impl, scan_name in SCAN_IMPLS_WITH_FOR)
  @jtu.skip_on_flag("jax_skip_slow_tests", True)
  def testScanGrad(self, jit_scan, jit_f, scan):
    rng = self.rng()

    d = rng.randn(2)
    def f(c, a):
      assert a.shape == (3,)
      assert c.shape == (4,)
      b = jnp.sum(jnp.sin(a)) + jnp.sum(jnp.sin(c)) + jnp.sum(jnp.sin(d))
      c = jnp.sin(c * b)
      assert b.shape == ()
      return c, b

    on_gpu = jtu.device_under_test() == "gpu"
    if scan is scan_with_new_checkpoint:
      rtol = {np.float32: 5e-5, np.float64: 1e-10 if on_gpu else 1e-13}
      atol = 1e-5
    else:
      rtol = {np.float32: 2e-4, np.float64: 1e-10 if on_gpu else 1e-13}
      atol = {np.float32: 8e-5, np.float64: 1e-10 if on_gpu else 1e-13}

    if jit_f:
      f = jax.jit(f)
    if jit_scan:
      scan = jax.jit(scan, static_argnums=(0,))

    as_ = rng.randn(5, 3)
    c = rng.randn(4)

    ans = jax.grad(lambda c, as_:      list(          scan(f, c, as_))[0].sum())(c, as_)
    expected = jax.grad(lambda c, as_: list(scan_reference(f, c, as_))[0].sum())(c, as_)
    self.assertAllClose(ans, expected, check_dtypes=False, rtol=rtol, atol=atol)

    rtol = 5e-1 if scan is not scan_with_new_checkpoint2 else 5e-2
    atol = 5e-2 if jtu.test_device_matches(["tpu"]) else 1e-3
    jtu.check_grads(partial(scan, f), (c, as_), order=2, modes=["rev"],
                    atol=atol, rtol=rtol)

  @jtu.skip_on_devices("tpu")  # TPU lacks precision for this test.
  @jtu.skip_on_flag("jax_skip_slow_tests", True)
  def testScanRnn(self):
    r = self.rng()

    n_in = 4
    n_hid = 2
    n_out = 1
    length = 3

    W_trans = r.randn(n_hid, n_hid + n_in).astype(jnp.float_)
    W_out = r.randn(n_out, n_hid + n_in).astype(jnp.float_)
    params = W_trans, W_out

    inputs = r.randn(length, n_in).astype(jnp.float_)
    targets = r.randn(length, n_out).astype(jnp.float_)

    def step(params, state, input):
      W_trans, W_out = params
      stacked = jnp.concatenate([state, input])
      output = jnp.tanh(jnp.dot(W_out, stacked))
      next_state = jnp.tanh(jnp.dot(W_trans, stacked))
      return next_state, output

    def rnn(params, inputs):
      init_state = jnp.zeros(n_hid)
      _, outputs = lax.scan(partial(step, params), init_state, inputs)
      return outputs

    @jax.jit
    def loss(params, inputs, targets):
      predictions = rnn(params, inputs)
      return jnp.sum((predictions - targets)**2)

    # evaluation doesn't crash
    loss(params, inputs, targets)

    # jvp evaluation doesn't crash
    jax.jvp(lambda params: loss(params, inputs, targets), (params,), (params,))

    # jvp numerical check passes
    jtu.check_grads(loss, (params, inputs, targets), order=2, modes=["fwd"],
                    rtol={np.float32: 2e-2, np.float64: 1e-6})

    # linearize works
    _, expected = jax.jvp(loss, (params, inputs, targets),
                          (params, inputs, targets))
    _, linfun = jax.linearize(loss, params, inputs, targets)
    ans = linfun(params, inputs, targets)
    self.assertAllClose(ans, expected, check_dtypes=False)

    # gradient evaluation doesn't crash
    jax.grad(loss)(params, inputs, targets)

    # gradient check passes
    jtu.check_grads(loss, (params, inputs, targets), order=2, rtol=2e-2)

    # we can vmap to batch things
    batch_size = 7
    batched_inputs = r.randn(batch_size, length, n_in).astype(jnp.float_)
    batched_targets = r.randn(batch_size, length, n_out).astype(jnp.float_)
    batched_loss = jax.vmap(lambda x, y: loss(params, x, y))
    losses = batched_loss(batched_inputs, batched_targets)
    expected = np.stack(list(map(lambda x, y: loss(params, x, y),
                                  batched_inputs, batched_targets)))
    self.assertAllClose(losses, expected, check_dtypes=False, rtol=1e-2)

  @parameterized.named_parameters(
      {"testcase_name": f"_impl={scan_name}", "scan": scan_impl}
      for scan_impl, scan_name in SCAN_IMPLS_WITH_FOR)
  def testIssue711(self, scan):
    # Tests reverse-mode differentiation through a scan for which the scanned
    # function also involves reverse-mode differentiation.
    # See https://github.com/jax-ml/jax/issues/711
    def harmonic_bond(conf, params):
      return jnp.sum(conf * params)

    def minimize_structure(test_params):
      energy_fn = partial(harmonic_bond, params=test_params)

      def apply_carry(carry, _):
        i, x = carry
        new_x = x - 0.1 * jax.grad(energy_fn)(x)
        new_carry = (i+1, new_x)
        return new_carry, _

      x0 = jnp.array([1., 2., 3.])
      carry_final, _ = scan(apply_carry, (0, x0), jnp.zeros((75, 0)))
      _, x_final = carry_final
      return x_final

    initial_params = 0.5
    minimize_structure(initial_params)  # doesn't crash

    def loss(test_params):
      x_final = minimize_structure(test_params)
      return jnp.sum(jnp.sin(1.0 - x_final))

    jax.grad(loss)(0.25)  # doesn't crash

  def testIssue744(self):
    Point = collections.namedtuple('Point', ['x', 'y'])
    p0 = Point(x=jnp.array(1), y=jnp.array(2))

    def plus_one(p, iter_idx):
      return Point(p.x+1, p.y+1), iter_idx

    self.assertRaisesRegex(
        ValueError,
        'scan got value with no leading axis to scan over.*',
        lambda: lax.scan(plus_one, p0, list(range(5))))

  def testScanBodyOutputError(self):
    with self.assertRaisesRegex(
        TypeError,
        re.escape("scan body output must be a pair, got float32[].")):
      lax.scan(lambda c, x: np.float32(0.), 0, jnp.arange(5.))

  def testScanMetadataError(self):
    # Regression test for https://github.com/jax-ml/jax/issues/25507
    def f(loop_i, x):
      return {'T': jnp.array([0.5])}

    init_val = {'t': jnp.array([1.0])}
    msg = r".*with pytree metadata \('t',\).*with pytree metadata \('T',\)"
    with self.assertRaisesRegex(TypeError, msg):
      jax.lax.fori_loop(0, 1, f, init_val)

  def testScanBodyCarryPytreeMismatchErrors(self):
    with self.assertRaisesRegex(
        TypeError,
        re.escape("function carry input and carry output must have "
                  "the same pytree structure, but they differ:\n\n"
                  "The input carry c is a tuple of length 2")):
      lax.scan(lambda c, x: ((0, 0, 0), x), (1, (2, 3)), jnp.arange(5.))

    with self.assertRaisesRegex(
        TypeError,
        re.escape("function carry input and carry output must have the "
                  "same pytree structure, but they differ:\n\n"
                  "The input carry x is a tuple of length 2")):
      lax.scan(lambda x, _: ((x[0].astype('float32'),), None),
               (jnp.array(0, 'int32'),) * 2, None, length=1)

    with self.assertRaisesRegex(
        TypeError,
        re.escape("function carry input and carry output must have the "
                  "same pytree structure, but they differ:\n\n"
                  "The input carry x is a <class 'tuple'> but the corres")):
      jax.lax.scan(lambda x, _: ([x[0].astype('float32'),] * 2, None),
                   (jnp.array(0, 'int32'),) * 2, None, length=1)

    with self.assertRaisesRegex(
        TypeError,
        re.escape("function carry input and carry output must have the "
                  "same pytree structure, but they differ:\n\n"
                  "The input carry x is a <class 'dict'> with 1 child but")):
      jax.lax.scan(lambda x, _: ({'a': x['a'], 'b': x['a']}, None),
                   {'a': jnp.array(0, 'int32')}, None, length=1)

    with self.assertRaisesRegex(
        TypeError,
        re.escape("function carry input and carry output must have the "
                  "same pytree structure, but they differ:\n\n"
                  "  * the input carry component x[0] is a <class 'dict'> with "
                  "1 child but the corresponding component of the carry "
                  "output is a <class 'dict'> with 2 children")):
      jax.lax.scan(lambda x, _: (({'a': x[0]['a'], 'b': x[0]['a']},) * 2, None),
                   ({'a': jnp.array(0, 'int32')},) * 2, None, length=1)

  def testScanBodyCarryTypeMismatchErrors(self):
    with self.assertRaisesRegex(
        TypeError,
        re.escape("function carry input and carry output must have equal "
                  "types, but they differ:\n\n"
                  "The input carry x has type int32[] but the corresponding "
                  "output carry component has type float32[], so the dtypes do "
                  "not match"
                  )):
      jax.lax.scan(lambda x, _: (x.astype('float32'), None),
                   jnp.array(0, 'int32'), None, length=1)

    with self.assertRaisesRegex(
        TypeError,
        re.escape("function carry input and carry output must have equal "
                  "types, but they differ:\n\n"
                  "The input carry component x[1] has type int32[] but the "
                  "corresponding output carry component has type float32[], "
                  "so the dtypes do not match"
                  )):
      jax.lax.scan(lambda x, _: ((x[0], x[1].astype('float32')), None),
                   (jnp.array(0, 'int32'),) * 2, None, length=1)

    with self.assertRaisesRegex(
        TypeError,
        re.escape("function carry input and carry output must have equal "
                  "types, but they differ:\n\n"
                  "  * the input carry component x[0] has type int32[] but the "
                  "corresponding output carry component has type float32[], "
                  "so the dtypes do not match;\n"
                  "  * the input carry component x[1] has type int32[] but the "
                  "corresponding output carry component has type float32[1,1], "
                  "so the dtypes do not match, and the shapes do not match."
                  )):
      jax.lax.scan(lambda x, _: ((x[0].astype('float32'),
                                  x[1].astype('float32').reshape(1, 1),
                                  x[2]), None),
                   (jnp.array(0, 'int32'),) * 3, None, length=1)

  def testScanLengthError(self):
    x = jnp.arange(10)
    with self.assertRaisesWithLiteralMatch(
        ValueError,
        "scan got `length` argument of 5 which disagrees with leading axis sizes [10]."):
      jax.lax.scan(lambda *args: args, 0, x, length=5)

  @jax.enable_checks(False)
  def testScanInvalidUnrollRaises(self):
    with self.assertRaisesRegex(ValueError, "`unroll` must be"):
      jax.lax.scan(lambda x, _: (x, x), 0, jnp.arange(5), unroll=-1)

  @parameterized.named_parameters(
      {"testcase_name": f"_{scan_name}",
       "scan": scan_impl}
      for scan_impl, scan_name in SCAN_IMPLS_WITH_FOR)
  def testScanHigherOrderDifferentiation(self, scan):
    d = 0.75
    def f(c, a):
      b = jnp.sin(c * jnp.sum(jnp.cos(d * a)))
      c = 0.9 * jnp.cos(d * jnp.sum(jnp.sin(c * a)))
      return c, b

    as_ = jnp.arange(6.).reshape((3, 2))
    c = jnp.array(1, dtype=as_.dtype)

    jtu.check_grads(lambda c, as_: scan(f, c, as_), (c, as_),
                    modes=["rev"], order=2, rtol={np.float32: 6e-3})

  @parameterized.named_parameters(
      {"testcase_name": f"_{jit_scan=}_{jit_f=}_{in_axes=}_impl={scan_name}",
       "jit_scan": jit_scan, "jit_f": jit_f, "in_axes": in_axes,
       "scan": scan_impl}
      for jit_scan in [False, True]
      for jit_f in [False, True]
      for scan_impl, scan_name in SCAN_IMPLS_WITH_FOR
      for in_axes in itertools.product([None, 0, 1], [None, 0, 1, 2])
      if in_axes != (None, None))
  def testScanVmap(self, jit_scan, jit_f, in_axes, scan):
    rng = self.rng()

    d = rng.randn(2)
    def f(c, a):
      assert a.shape == (3,)
      assert c.shape == (4,)
      b = jnp.cos(jnp.sum(jnp.sin(a)) + jnp.sum(jnp.cos(c)) + jnp.sum(d))
      c = jnp.sin(c * b)
      assert b.shape == ()
      return c, b

    if jit_f:
      f = jax.jit(f)
    if jit_scan:
      scan = jax.jit(scan, static_argnums=(0,))

    as_shape = [5, 3]
    c_shape = [4]

    c_bdim, as_bdim = in_axes
    if c_bdim is not None:
      c_shape.insert(c_bdim, 7)
    if as_bdim is not None:
      as_shape.insert(as_bdim, 7)

    as_ = rng.randn(*as_shape)
    c = rng.randn(*c_shape)

    ans = jax.vmap(lambda c, as_:                scan(f, c, as_), in_axes)(c, as_)
    expected = jax.vmap(lambda c, as_: scan_reference(f, c, as_), in_axes)(c, as_)
    self.assertAllClose(ans, expected, check_dtypes=False,
                        rtol=1e-5, atol=1e-5)

  def testScanVmapTuples(self):
    def f(c, a):
      a1, a2 = a
      c1, c2 = c
      b = jnp.sum(jnp.cos(a1)) * jnp.sum(c2 * a2)
      c = c1 * jnp.sin(jnp.sum(a1 * a2)), c2 * jnp.cos(jnp.sum(a1))
      return c, b

    in_axes = (0, (1, 2))

    r = self.rng()
    as_ = (r.randn(3, 7), r.randn(3, 4, 7))
    c = (r.randn(7, 2), r.randn(7))

    expected_c_out, expected_bs = [], []
    for i in range(7):
      c_out, bs = lax.scan(f, (c[0][i], c[1][i]), (as_[0][:,i], as_[1][:,:,i]))
      expected_c_out.append(c_out)
      expected_bs.append(bs)
    expected_c_out_0, expected_c_out_1 = unzip2(expected_c_out)
    expected_c_out = (jnp.stack(expected_c_out_0), jnp.stack(expected_c_out_1))
    expected_bs = jnp.stack(expected_bs)
    expected = expected_c_out, expected_bs

    ans = jax.vmap(lambda c, as_:            lax.scan(f, c, as_), in_axes)(c, as_)
    self.assertAllClose(ans, expected, check_dtypes=False)

  @parameterized.named_parameters(
      {"testcase_name": f"_impl={scan_name}", "scan": scan_impl}
      for scan_impl, scan_name in SCAN_IMPLS_WITH_FOR)
  def testScanVmapFixpoint(self, scan):
    def f(carry_init):
      def scan_body(c, x):
        # The carry is a 4-tuple, the last element starts batched,
        # and the carry is shifted left at each iteration.
        return ((c[1], c[2], c[3], 0.), None)
      return scan(scan_body, (0., 1., 2., carry_init), jnp.zeros(2))
    carry_init = jnp.array([3., 4., 5.])
    carry_out, _ = jax.vmap(f)(carry_init)
    self.assertAllClose(carry_out[3], jnp.array([0., 0., 0.]), check_dtypes=False)
    self.assertAllClose(carry_out[2], jnp.array([0., 0., 0.]), check_dtypes = False)
    # After two shifts, we get the carry_init
    self.assertAllClose(carry_out[1], carry_init, check_dtypes=False)
    self.assertAllClose(carry_out[0], jnp.array([2., 2., 2.]), check_dtypes = False)

  def testIssue757(self):
    # code from https://github.com/jax-ml/jax/issues/757
    def fn(a):
      return jnp.cos(a)

    def loop(val):
      iterations = 10

      def apply_carry(x, i):
        return jax.grad(fn, argnums=(0,))(x)[0], i

      final_val, _ = lax.scan(apply_carry, val, jnp.arange(iterations))
      return final_val

    arg = 0.5
    jax.jit(jax.jacfwd(loop, argnums=(0,)))(arg)  # doesn't crash

  def testIssue804(self):
    # https://github.com/jax-ml/jax/issues/804
    num_devices = jax.device_count()
    f = partial(lax.scan, lambda c, x: (c + lax.psum(x, "i") , c), 0.)
    jax.pmap(f, axis_name="i")(jnp.ones((num_devices, 4)))  # doesn't crash

  # This second caching test shows a different kind of caching that we haven't
  # implemented (but could!), namely that Python functions that are distinct
  # objects but are equivalent functions trigger cache hits. This kind of
  # caching could be salient when using lambda functions with control flow:
  #
  #   lax.while_loop(lambda x: x < 5, lambda x: x + 2, 0)
  #   lax.while_loop(lambda x: x < 5, lambda x: x + 2, 0)
  #
  # To get a cache hit on the second line we'd need to form a jaxpr and
  # compare them for equality (including the literals on identity). We could
  # implement that by adding a __hash__/__eq__ to core.Jaxpr and
  # core.ClosedJaxpr (see #1221).
  def test_caches_depend_on_axis_env(self):
    # https://github.com/jax-ml/jax/issues/9187
    scanned_f = lambda _, __: (lax.axis_size('i'), None)
    f = lambda: lax.scan(scanned_f, 0, None, length=1)[0]
    ans = jax.vmap(f, axis_name='i', axis_size=2, out_axes=None)()
    self.assertEqual(ans, 2)
    ans = jax.vmap(f, axis_name='i', axis_size=3, out_axes=None)()
    self.assertEqual(ans, 3)

  @parameterized.named_parameters(
      dict(testcase_name=f"_{loop=}", loop=loop)
      for loop in ["while", "fori_inside_cond", "fori_inside_scan"])
  def testWhileGradError(self, loop: str = "fori_inside_scan"):
    # Raise error for vjp for loops
    if loop == "while":
      func = lambda x: lax.while_loop(lambda i: i < 5., lambda i: i + 1., x)
    elif loop == "fori_inside_jit":
      func = jax.jit(lambda x: lax.fori_loop(x, x + 2., lambda i, c: c, x))
    elif loop == "fori_inside_cond":
      func = lambda x: lax.cond(
          True,
          lambda x, _: lax.fori_loop(x, x + 2., lambda i, c: c * 2., x),
          lambda _, x: x,
          x, 1.)
    elif loop == "fori_inside_scan":
      func = lambda x: lax.scan(
          lambda c, x: (lax.fori_loop(x, x + 2., lambda i, c1: c1 * c, x), None),
          x, np.ones(2))[0]
    else:
      assert False

    with self.assertRaisesRegex(ValueError, "Reverse-mode differentiation does not work for lax.while_loop"):
      jax.grad(func)(1.)

    jax.linearize(func, 1.)  # Linearization works

  @jax.legacy_prng_key('allow')
  def testIssue1316(self):
    def f(carry, _):
      c, key = carry
      key, _ = random.split(key)
      return (c, key), ()

    key = random.PRNGKey(0)
    jax.grad(lambda c: lax.scan(f, (c, key), np.ones(3))[0][0])(0.)  # doesn't crash

  def testIssue1361(self):
    @jax.jit
    def jit_run_scan(x):
      def fun(carry, _):
        x, _ = carry
        return (2 * x, 0.), None
      (x, _), _ = lax.scan(fun, (x, 0.), jnp.arange(3))
      return x

    jax.grad(lambda x: jit_run_scan(x))(0.)  # doesn't crash

  def testIssue810(self):
    def loss(A):
      def step(x, i):
        return jnp.matmul(A, x), None
      init_x = jnp.zeros(A.shape[-1:])
      last_x, _ = lax.scan(step, init_x, jnp.arange(10))
      return jnp.sum(last_x)

    A = jnp.zeros((3, 3))
    # The second DUS was unnecessarily replicating A across time.
    # We check XLA because _scan_impl is "underneath" the jaxpr language.
    s = jax.jit(jax.grad(loss)).lower(A).as_text('hlo')
    assert s.count("dynamic-update-slice(") < 2

  def testScanLengthArg(self):
    def arange(n):
      return lax.scan(lambda c, _: (c + 1, c), 0, None, length=n)[1]

    ans = arange(10)
    expected = np.arange(10)
    self.assertAllClose(ans, expected, check_dtypes=False)

  @parameterized.named_parameters(
      {"testcase_name": f"_{scan_name}",
       "scan": scan_impl}
      for scan_impl, scan_name in SCAN_IMPLS_WITH_FOR)
  def test_scan_reverse(self, scan):
    def cumsum(x, reverse):
      return scan(lambda c, x: (c + x, c + x), 0, x, reverse=reverse)[1]

    x = np.array([3, 1, 4, 1, 5, 9])
    self.assertAllClose(np.cumsum(x), cumsum(x, False), check_dtypes=False)
    self.assertAllClose(np.cumsum(x[::-1])[::-1], cumsum(x, True), check_dtypes=False)

    with jax.disable_jit():
      self.assertAllClose(np.cumsum(x), cumsum(x, False), check_dtypes=False)
    with jax.disable_jit():
      self.assertAllClose(np.cumsum(x[::-1])[::-1], cumsum(x, True), check_dtypes=False)

  def test_scan_unroll(self):
    d = jnp.ones(2)
    def f(c, a):
      assert a.shape == (3,)
      assert c.shape == (4,)
      b = jnp.cos(jnp.sum(jnp.sin(a)) + jnp.sum(jnp.cos(c)) + jnp.sum(d))
      c = jnp.sin(c * b)
      assert b.shape == ()
      return c, b

    xs = jnp.ones((20, 3))
    c = jnp.ones(4)

    scan = lambda c, xs: lax.scan(f, c, xs)
    scan_unrolled = lambda c, xs: lax.scan(f, c, xs, unroll=2)
    scan_fully_unrolled = lambda c, xs: lax.scan(f, c, xs, unroll=True)

    # jaxprs should be the same size
    self.assertEqual(
        len(str(jax.make_jaxpr(scan)(c, xs))),
        len(str(jax.make_jaxpr(scan_unrolled)(c, xs))))

    # but HLO should grow due to unrolling
    scan_hlo = str(jax.jit(scan).lower(c, xs).as_text("hlo"))
    scan_unrolled_hlo = str(jax.jit(scan_unrolled).lower(c, xs).as_text("hlo"))
    scan_fully_unrolled_hlo = str(
        jax.jit(scan_fully_unrolled).lower(c, xs).as_text("hlo"))

    self.assertLess(len(scan_hlo), len(scan_unrolled_hlo))
    self.assertLess(len(scan_unrolled_hlo), len(scan_fully_unrolled_hlo))

    # and the lowering should contain a while loop, unless the scan is fully
    # unrolled
    self.assertIn("while(", scan_hlo)
    self.assertIn("while(", scan_unrolled_hlo)
    self.assertNotIn("while(", scan_fully_unrolled_hlo)

  def test_scan_xs_none(self):
    def f(h, _):
      return h + 1, None

    length = 20
    h, _ = lax.scan(f, 0, length=length)
    self.assertEqual(h, length)

  def test_scan_typecheck_param(self):
    d = jnp.ones(2)
    def f(c, a):
      b = jnp.cos(jnp.sum(a) + jnp.sum(c) + jnp.sum(d))
      c = jnp.sin(c * b)
      return c, b

    xs = jnp.ones((5, 3))
    c = jnp.ones(4)
    scan_fun = lambda c, xs: lax.scan(f, c, xs)

    def new_jaxpr():
      jaxpr = jax.make_jaxpr(partial(scan_fun))(c, xs).jaxpr
      scan = next(eqn for eqn in jaxpr.eqns if eqn.primitive.name == 'scan')
      return jaxpr, scan

    jaxpr, eqn = new_jaxpr()
    eqn.params['reverse'] = 4
    self.assertRaisesRegex(
        core.JaxprTypeError,
        re.escape('invalid scan param reverse of type int, bool required: 4'),
        lambda: core.check_jaxpr(jaxpr))

    jaxpr, eqn = new_jaxpr()
    eqn.params['num_consts'] = -3
    self.assertRaisesRegex(
        core.JaxprTypeError,
        re.escape('invalid scan param num_consts of type int, '
                  'non-negative int required: -3'),
        lambda: core.check_jaxpr(jaxpr))

  @parameterized.named_parameters(
      {"testcase_name": f"_dtype={dtype.__name__}", "dtype": dtype}
      for dtype in jtu.dtypes.all_integer)
  def test_scan_init_weak_type(self, dtype):
    def func(carry, x):
      return carry + x, x
    init_weak = 0  # Python scalars are weakly-typed.
    x = jnp.ones(5, dtype=dtype)
    carry, result = lax.scan(func, init_weak, x)
    self.assertEqual(carry, x.sum(dtype=carry.dtype))
    self.assertArraysEqual(result, x)

  @parameterized.named_parameters(
      {"testcase_name": f"{suffix}", "remat": remat}
      for suffix, remat in [
          ('', None),
          ('new_remat', jax.checkpoint),
      ])
  def test_scan_vjp_forwards_extensive_residuals(self, remat):
    # https://github.com/jax-ml/jax/issues/4510
    def cumprod(x):
      s = jnp.ones((2, 32), jnp.float32)
      return lax.scan(lambda s, x: (x*s, s), s, x)
    if remat is not None:
      cumprod = remat(cumprod)

    rng = self.rng()
    x = jnp.asarray(rng.randn(32, 2, 32).astype('float32'))
    _, vjp_fun = jax.vjp(cumprod, x)

    # TODO(mattjj): should we re-enable this check? The constants are now
    # inlined in the Jaxprs, not easy to find them.
    # ==> Yes, we don't want to change autodiff const behavior. We must make
    # these tessts pass under use_simplified_jaxpr_constants.
    if not config.use_simplified_jaxpr_constants.value:
      ext_res, = vjp_fun.args_res
      self.assertIs(ext_res, x)

    if remat is not None:
      # TODO(mattjj): make the numpy.ndarray test pass w/ remat
      raise unittest.SkipTest("new-remat-of-scan doesn't convert numpy.ndarray")

    x = rng.randn(32, 2, 32).astype('float32')  # numpy.ndarray, not Array
    _, vjp_fun = jax.vjp(cumprod, x)
    if not config.use_simplified_jaxpr_constants.value:
      ext_res, *_ = vjp_fun.opaque_residuals
      self.assertIsInstance(ext_res, jax.Array)

  def test_scan_vmap_collectives(self):
    def scan_f(state, x):
      s = lax.psum(state, 'i') * x
      return state, s

    def scan(state, xs):
      return lax.scan(scan_f, state, xs)

    scan_v = jax.vmap(scan, in_axes=0, out_axes=0, axis_name='i')
    self.assertAllClose(
      scan_v(jnp.ones([1]), jnp.arange(5.).reshape((1, 5))),
      (jnp.array([1.]), jnp.array([[0., 1., 2., 3., 4.]])), check_dtypes=False)

  def test_xla_cpu_gpu_loop_cond_bug(self):
    # https://github.com/jax-ml/jax/issues/5900
    def deriv(f):
      return lambda x, *args: jax.linearize(lambda x: f(x, *args), x)[1](1.0)

    def _while_loop(cond_fun, body_fun, init_val, max_iter):
      def _iter(val):
        next_val = body_fun(val)
        next_cond = True
        return next_val, next_cond

      def _fun(tup, _):
        val, cond = tup
        return jax.lax.cond(cond, _iter, lambda x: (x, False), val), _

      init = (init_val, cond_fun(init_val))
      return jax.lax.scan(_fun, init, None, length=max_iter)[0][0]

    def my_pow(x, y):
      def body_fun(val):
        return val * x
      def cond_fun(val):
        return True
      return _while_loop(cond_fun, body_fun, 1.0, y)

    self.assertAllClose(deriv(my_pow)(3.0, 1), 1.0, check_dtypes=False)

  @parameterized.named_parameters(
      {"testcase_name": f"impl={scan_name}", "scan": scan_impl}
      for scan_impl, scan_name in SCAN_IMPLS_WITH_FOR)
  def test_scan_hoisting_consts(self, scan):
    A = jnp.arange(4.).reshape(2, 2)
    B = jnp.arange(4.).reshape(2, 2) + 1.

    def f(x):
      def body(c, _):
        c1, c2, c3 = c
        return (jnp.dot(A, c1), jnp.dot(B, c2), jnp.dot(jnp.sin(B), c3)), None
      init_carry = (x * jnp.ones(2), x * jnp.ones(2), x * jnp.ones(2))
      (c1, c2, c3), _ = scan(body, init_carry, None, length=3)
      return jnp.sum(c1) + jnp.sum(c2) + jnp.sum(c3)

    jax.grad(f)(1.)  # doesn't crash

  def test_platform_dependent_with_primitive_with_lowering_error(self):
    if not jtu.test_device_matches(["cpu", "tpu"]):
      self.skipTest("Only for CPU and TPU")

    def f(x):
      return lax.platform_dependent(
          x,
          # Check that we only lower on the intended platform
          cpu=lambda x: prim_with_lowering_error.bind(x, only_on="cpu"),
          tpu=lambda x: prim_with_lowering_error.bind(x, only_on="tpu"))

    self.assertAllClose(np.sin(1.), f(1.))  # Eager
    self.assertAllClose(np.sin(1.), jax.jit(f)(1.))
    self.assertAllClose(np.sin(1.), lax.cond(True, f, lambda x: x, 1.))
    self.assertAllClose(1., lax.cond(False, f, lambda x: x, 1.))
    self.assertAllClose((0., np.sin(np.arange(8.))),
                        lax.scan(lambda carry, x: (carry, f(x)),
                                 0., np.arange(8.)))
    self.assertAllClose(np.sin(np.arange(8.)), jax.vmap(f)(np.arange(8.)))

  def test_platform_dependent_grad(self):
    # For a function "lax.dot(x, x)", we choose two branches with very different
    # implementations (a dot and a scan), and therefore different residuals,
    # so that we can verify whether the residuals are as we expect (we don't
    # get residuals from a different platform.
    x = np.arange(8, dtype=np.float32)
    def f_impl_dot(x):  # x: f32[8]
      return jnp.dot(x, x)
    def f_impl_scan(x):
      def scan_body(carry, x_i):
        return (carry + x_i * x_i, None)
      return lax.scan(scan_body, np.float32(0.), x)[0]

    def f(x):
      return jnp.sin(lax.platform_dependent(x,
                                            cpu=f_impl_dot,
                                            default=f_impl_scan))
    self.assertAllClose(
      jax.grad(f)(x),
      jax.grad(lambda x: jnp.sin(f_impl_dot(x)))(x))

    # Check that we do not have contamination of computations across platforms
    hlo = jax.jit(jax.grad(f)).lower(x).as_text('hlo')
    expect_a_dot = (jtu.device_under_test() == "cpu")
    self.assertEqual(expect_a_dot, " dot(" in hlo)
    self.assertEqual(not expect_a_dot, " while(" in hlo)

  def test_scan_lowering_doesnt_introduce_singleton(self):
    b = 4
    i = 2

    def scan(y):
      def body(carry, x):
        return carry, jnp.dot(x, x)
      return jax.lax.scan(body, 1.0, y, unroll=False)

    fn = jax.jit(scan)

    init = np.array(np.arange(b * i * i), dtype=np.float32).reshape((b, i, i))
    hlo_text = fn.lower(init).as_text('hlo')
    self.assertNotIn('4,1,2,2', hlo_text)

  def test_scan_length_concrete_error(self):
    f = jax.jit(lambda n, x: jax.lax.scan(lambda c, z: (c, z), x, (), n))

    with self.assertRaisesRegex(
        core.ConcretizationTypeError,
        "The `length` argument to `scan` expects a concrete `int` value.*"):
      f(3, 1.)

  def test_scan_unroll_concrete_error(self):
    f = jax.jit(lambda n, x: jax.lax.scan(
        lambda c, z: (c, z), x, (), 10, unroll=n))

    msg = ("The `unroll` argument to `scan` expects a concrete `int` or "
           "`bool` value.*")
    with self.assertRaisesRegex(core.ConcretizationTypeError, msg):
      f(3, 1.)
    with self.assertRaisesRegex(core.ConcretizationTypeError, msg):
      f(True, 1.)

  def test_scan_readonly_carry_optimization(self):
    # https://github.com/google/flax/issues/4709
    def f(x, y):
      def g(_, y):
        y, _ = jax.lax.scan(lambda y, _: (y, None), y, None, length=1)
        return y
      return jax.lax.cond(x < 0, g, g, x, y)
    xs = jnp.arange(3.)
    y = 3.
    jax.vmap(f, (0, None), None)(xs, y)  # don't crash

  @parameterized.parameters(itertools.product(range(3), repeat=4))
  @jtu.run_on_devices("cpu")
  def test_scan_constification_correctness(
      self,
      seed,
      num_body_consts,
      num_inplace_fwds,
      num_noninplace_fwds):

    num_fwds = num_inplace_fwds + num_noninplace_fwds
    num_carry = num_fwds + 4
    num_xs = 2
    num_ys = 3

    rng = np.random.RandomState(seed)
    perm = rng.permutation(num_carry)
    iperm = np.argsort(perm)

    body_consts = [rng.randn(3) for _ in range(num_body_consts)]
    init_vals = list(rng.uniform(size=num_carry))

    def body_fun(c, _):
      c = [c[i] for i in iperm]
      inplace_fwds, noninplace_fwds, dont_fwd = split_list(
          c, [num_inplace_fwds, num_noninplace_fwds])
      dont_fwd = [jnp.sin(x) * sum(jnp.sum(c) for c in body_consts)
                  for x in dont_fwd]
      new_c_perm = [*inplace_fwds, *dont_fwd, *noninplace_fwds]
      new_c = [new_c_perm[i] for i in perm]
      return new_c, [0 for _ in range(num_ys)]

    xs = [jnp.arange(2.) for _ in range(num_xs)]
    outs = jax.lax.scan(body_fun, init_vals, xs)[0]
    outs_ref = body_fun(body_fun(init_vals, [x[0] for x in xs])[0], [x[1] for x in xs])[0]
    self.assertAllClose(outs, outs_ref, check_dtypes=False)

  @parameterized.parameters(itertools.product(range(3), repeat=4))
  @jtu.run_on_devices("cpu")
  def test_scan_forwarding_correctness(
      self,
      seed,
      num_body_consts,
      num_const_fwds,
      num_input_fwds):

    num_carry = num_const_fwds + 4
    num_xs = num_input_fwds + 2
    num_ys = num_xs + 1

    rng = np.random.RandomState(seed)
    carry_perm = rng.permutation(num_carry)
    carry_iperm = np.argsort(carry_perm)

    xs_perm = rng.permutation(num_xs)
    ys_perm = rng.permutation(num_ys)
    f = np.arange(num_xs)
    f = [f[i] if idx < num_input_fwds else None for idx, i in enumerate(xs_perm)]
    f += [None]
    in_fwd = [f[i] for i in ys_perm]

    body_consts = [rng.randn(3) for _ in range(num_body_consts)]
    init_vals = list(rng.uniform(size=num_carry))

    def body_fun(c, x):
      c = [c[i] for i in carry_iperm]
      carry_fwds, carry_dont_fwd = split_list(c, [num_const_fwds])
      carry_dont_fwd = [jnp.sin(x) * sum(jnp.sum(c) for c in body_consts)
                        for x in carry_dont_fwd]
      new_c_perm = [*carry_fwds, *carry_dont_fwd]
      new_c = [new_c_perm[i] for i in carry_perm]

      x = [x[i] for i in xs_perm]
      x_fwd, x_dont_fwd = split_list(x, [num_input_fwds])
      x_dont_fwd = [jnp.cos(x) * sum(jnp.sum(c) for c in body_consts)
                    for x in x_dont_fwd]
      y = [*x_fwd, *x_dont_fwd, 0]
      y = [y[i] for i in ys_perm]

      return new_c, y

    xs = list(rng.uniform(size=(num_xs, 2)))
    final, outs = jax.lax.scan(body_fun, init_vals, xs)
    for f, y in zip(in_fwd, outs):
      if f is not None:
        self.assertAllClose(y, xs[f])

    final_ref = body_fun(body_fun(init_vals, [x[0] for x in xs])[0], [x[1] for x in xs])[0]
    self.assertAllClose(final, final_ref, check_dtypes=False)

  def test_scan_diff_of_print(self):
    # ref: https://github.com/jax-ml/jax/issues/28738
    def f(c, _):
      jax.debug.print("c = {c}", c=c, ordered=True)
      return c + 1, None
    def g(x):
      return jax.lax.scan(f, x, length=2)[0]
    jaxpr = jax.make_jaxpr(jax.value_and_grad(g))(1.0)
    eqn_jaxpr = jaxpr.eqns[0].params["jaxpr"]
    self.assertIn("debug_print", [e.primitive.name for e in eqn_jaxpr.eqns])

  def test_scan_input_to_output_forwarding(self):
    def f(c, x):
      return c + 1, x
    def g(x):
      return jax.lax.scan(f, 0, x)
    jaxpr = jax.make_jaxpr(g)(jnp.arange(3.))
    self.assertLen(jaxpr.eqns[0].params["jaxpr"].jaxpr.outvars, 1)

  @jtu.sample_product(
      seed=range(6),
      num_rule_consts=range(6),
      num_const_fwds=range(6),
      num_carry_fwds=range(6),
      num_input_fwds=range(6),
  )
  @jtu.run_on_devices("cpu")
  def test_scan_vjp_forwarding_correctness(
      self,
      seed,
      num_rule_consts,
      num_const_fwds,
      num_carry_fwds,
      num_input_fwds):
    # Unlike test_scan_forwarding_correctness, which tests forwarding in the
    # scan traceable, this test covers forwarding logic related to residuals in
    # the scan partial eval / vjp rule. So 'forwards' refer to residuals that
    # will be forwarded.

    # We use a custom_jvp where the jvp rule introduces consts to populate
    # jaxpr.consts in _scan_partial_eval's input.
    @jax.custom_jvp
    def foo(x):
      return 3. * x
    @foo.defjvp
    def foo_jvp(primals, tangents):
      (x,), (x_dot,) = primals, tangents
      if num_rule_consts:
        coeff = sum([jnp.array(np.ones(3) / num_rule_consts) for _ in range(num_rule_consts)])  # noqa: C419
      else:
        coeff = 1.
      return foo(x), jnp.prod(coeff) * x_dot

    num_const = num_const_fwds + 2
    num_carry = num_carry_fwds + 4
    num_xs = num_input_fwds + 2
    num_ys = num_xs + 1

    rng = np.random.RandomState(seed)
    carry_perm = rng.permutation(num_carry)
    carry_iperm = np.argsort(carry_perm)

    xs_perm = rng.permutation(num_xs)
    ys_perm = rng.permutation(num_ys)
    f = np.arange(num_xs)
    f = [f[i] if idx < num_input_fwds else None for idx, i in enumerate(xs_perm)]
    f += [None]

    body_consts = [jnp.array(rng.randn(3)) for _ in range(num_const)]
    init_vals = list(map(jnp.array, rng.uniform(size=(num_carry, 3))))

    def body_fun(c, x):
      c = [c[i] for i in carry_iperm]

      const_fwds, const_dont_fwd = split_list(body_consts, [num_const_fwds])
      z = sum(const_dont_fwd)

      carry_fwds, carry_dont_fwd = split_list(c, [num_const_fwds])
      carry_fwds = [math.prod([x, x, *const_fwds, z]) for x in carry_fwds]
      carry_dont_fwd = [jnp.sin(x) * sum(jnp.sum(c) for c in body_consts)
                        for x in carry_dont_fwd]
      new_c_perm = [*carry_fwds, *carry_dont_fwd]
      new_c = [new_c_perm[i] for i in carry_perm]
      new_c = [foo(new_c[0]), *new_c[1:]]

      x = [x[i] for i in xs_perm]
      x_fwd, x_dont_fwd = split_list(x, [num_input_fwds])
      x_fwd = [x * x for x in x_fwd]
      x_dont_fwd = [jnp.cos(x) * sum(jnp.sum(c) for c in body_consts)
                    for x in x_dont_fwd]
      y = [*x_fwd, *x_dont_fwd, 0]
      y = [y[i] for i in ys_perm]

      return new_c, y

    xs = list(map(jnp.array, rng.uniform(size=(num_xs, 2))))

    (final, outs), vjp = jax.vjp(partial(jax.lax.scan, body_fun), init_vals, xs)
    init_vals_bar, xs_bar = vjp((final, outs))

    with jax.disable_jit():
      (final_ref, outs_ref), vjp = jax.vjp(partial(jax.lax.scan, body_fun), init_vals, xs)
      init_vals_bar_ref, xs_bar_ref = vjp((final, outs))

    self.assertAllClose(final, final_ref, check_dtypes=False, rtol=1e-5)
    self.assertAllClose(outs, outs_ref, check_dtypes=False)
    self.assertAllClose(xs_bar, xs_bar_ref, check_dtypes=False)

  def test_scan_fixpoint_instantiate(self):
    def f(x):
      c, () = jax.lax.scan(lambda c, _: ((0., 0.), ()), (x, 0.), (), length=5)
      return sum(c)
    jax.grad(f)(1.)  # doesn't crash

if __name__ == '__main__':
  absltest.main(testLoader=jtu.JaxTestLoader())
