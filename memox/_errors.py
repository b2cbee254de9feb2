"""Every message memox raises: what was wrong, what was received, and what to do."""

SLOT_NAME_NOT_STR = (
    "`memox.cached` takes the name of a `memox.Memo` field as a string; got {slot!r}. "
    'Pass the field\'s name, e.g. `@memox.cached("b_cache")`.'
)

UNKNOWN_SLOT = (
    "`memox.cached('{slot}')` on `{cls}.{name}`: `{cls}` has no field `{slot}`. {known}"
    "Declare it as `{slot}: memox.Memo[...] = memox.Memo()`{other}."
)

NOT_A_MEMO_FIELD = (
    "`memox.cached('{slot}')` on `{cls}.{name}`: field `{slot}` is declared as "
    "`{annotation}`, not as a `memox.Memo`. {known}Declare it as "
    "`{slot}: memox.Memo[...] = memox.Memo()`{other}."
)

# The parts of `UNKNOWN_SLOT` and `NOT_A_MEMO_FIELD` that name the class's slots.
SLOT_HINTS = {
    "closest": "Did you mean `{closest}`? ",
    "known": "Its `memox.Memo` fields: {fields}. ",
    "other": ", or pass one of those to `memox.cached`",
}

SLOT_TAKEN = (
    "`memox.cached('{slot}')` on `{cls}.{name}`: slot `{slot}` is already bound to "
    "`{cls}.{other}`. Give each cached method a `memox.Memo` field of its own."
)

NOT_CALLABLE = (
    "`memox.{api}`: `fn` must be callable; got {got}. Pass the function to run on the "
    "module, e.g. `memox.{api}(Foo.b)`."
)

SCAN_NOT_CALLABLE = (
    "`memox.scan`: `f`, as for `lax.scan`, must be callable, `f(carry, x) -> (carry, y)`; "
    "got {got}. Pass the loop body first: `memox.scan(body, init, xs)`."
)

JIT_DONATE = (
    "`memox.jit`: `donate` must be a bool; got {got}. Pass `donate=True` (the default: "
    "the module's slot buffers are donated) or `donate=False`. The strings `'all'`, "
    "`'none'`, ... are the `donate` of `eqx.filter_jit` and `memox.filter_jit`."
)

BOUND_METHOD = (
    "`memox.{api}`: `fn` is the bound method `{method}`, which carries its own copy of "
    "the module and would be called as `fn(module, ...)` with the module twice. Pass "
    "the unbound method instead: `{cls}.{name}`."
)

FIRST_ARGUMENT = (
    "`memox.jit`: the wrapped function's first argument must be the module; got {got} "
    "first{where}. Call `step(model, *args)` for `step = memox.jit(fn)`, where "
    "`fn(model, *args)` calls the cached methods."
)

SLOTS_IN_A_LATER_ARGUMENT = (
    "`memox.{api}`: the module given first holds no `memox.Memo` slot, but {where} does. "
    "memox caches the slots of the first argument only. Pass the module holding them "
    "first: `memox.call(model, fn, *args)`; for `step = memox.jit(fn)`, "
    "`step(model, *args)` with `fn(model, *args)`."
)

NO_SLOTS = (
    "`memox.{api}`: `module` holds no `memox.Memo` slot (got a `{got}`), so {what}. Pass "
    "the module whose cached methods you call, or a pytree holding it, as `module`. "
    "Its class declares a slot for each cached method: "
    '`b_cache: memox.Memo[...] = memox.Memo()`, bound by `@memox.cached("b_cache")`.'
)

# What a module holding no slot means, for each function refusing it.
NO_SLOTS_MEANS = {
    "call": "nothing `fn` computes can be cached",
    "init": "there is nothing to allocate",
    "stats": "there is nothing to count",
}

NOT_A_PYTREE = (
    "`memox.{api}`: `module` must be a pytree holding `memox.Memo` slots, typically an "
    "`eqx.Module`; got {got}, which JAX sees as a single leaf. Pass the module itself "
    "(`memox.{api}(model, ...)`), not one of its arrays or a plain Python object."
)

RESHAPED_IN_LOOP = (
    "`{method}` fills slot `{slot}` inside a `{loop}` body with a value of shape "
    "{new}, but the slot was allocated for {old}, and reallocating it would change the "
    "structure of the module (a loop carry must keep its structure). Allocate it for "
    "the new shapes before the loop: `module = memox.init(module, step, *args)` with "
    "arguments of those shapes."
)

UNALLOCATED_NESTED = (
    "`{method}` is reached from inside cached `{outer}`, and its slot `{slot}` is not "
    "allocated for a value of shape {new} yet; memox cannot allocate it inside another "
    "cached method's computation. Allocate it first: "
    "`module = memox.init(module, fn, *args)` with the function and arguments you "
    "call it with."
)

INNER_TRANSFORM = (
    "`{method}` updates slot `{slot}` with values that belong to a JAX transformation "
    "(`jax.vmap`, `jax.jit`, `lax.scan`, `lax.cond`, ...) opened inside `memox.call`, so "
    "the update (a fill, or the hit counters) cannot be written back to the module without "
    "leaking a tracer. This happens when the method runs inside that transformation's "
    "trace, or its dependencies or arguments are batched or carried by it. Either run "
    "`memox.call` inside the transformation (e.g. `jax.vmap(lambda x: memox.call(model, "
    "fn, x))`, or a scan whose carry is the module), or read the value before it "
    "(`value, model = memox.call(model, Foo.method)`) and use `value` inside."
)

UNSUPPORTED_DTYPE = (
    "`{method}` returned a leaf of dtype {dtype}; a `memox.Memo` slot holds boolean, "
    "integer, floating and complex arrays and typed PRNG keys. Return arrays of those "
    "dtypes, or drop `memox.cached` from this method."
)

BAD_SIZE = (
    "`memox.Memo(size=...)` takes the number of table entries, a positive int; got "
    "{size!r}. Use `memox.Memo()` for one entry, `memox.Memo(size=8)` for a table of 8."
)

NOT_A_POLICY = (
    "`memox.cached(..., policy=...)` got {got}. Pass a `memox.policies` policy, e.g. "
    "`policy=memox.policies.Drift(rtol=0.1)`."
)

NOT_CACHED = (
    "`memox.{api}(module, *methods)`: {got} is not a method decorated with "
    "`memox.cached`. Pass cached methods unbound, e.g. `memox.{api}(model, Foo.b)`."
)

DONATED_SLOTS = (
    "memox: slots {slots} were donated to an earlier `memox.jit` call and are gone from "
    "this module, so this call recomputes them. Keep using the module that call "
    "returned (`out, model = step(model, x)`), or make the step with "
    "`memox.jit(fn, donate=False)`."
)

NOT_EQX_MODULE = (
    "`memox.cached('{slot}')` on `{cls}.{name}`: `{cls}` is {kind}. memox caches in "
    "the fields of an `eqx.Module` (slots are pytree leaves threaded by `memox.call`). "
    "Define `{cls}` as an `equinox.Module` with a field "
    "`{slot}: memox.Memo[...] = memox.Memo()`."
)

UNREACHED_SLOT = (
    "`{method}` ran inside `memox.call` but its slot `{slot}` is not threaded through "
    "this call, so it computes every time and caches nothing. Either the module it ran "
    "on is not (part of) the module passed to `memox.call`, or the method runs inside a "
    "transformation opened inside `fn` that rebuilt the module (`eqx.filter_jit`, "
    "`jax.jit`, a loop, a diffrax solve, ...). Pass `memox.hoist(module)` into that "
    "transformation instead of the module (its cached values are read once, before it), "
    "or call `memox.call` inside it on the module it receives."
)

NONE_SLOT = (
    "`{{method}}` ran inside `memox.call` on a `{cls}` whose slot `{{slot}}` is None, so "
    "it computes every time and caches nothing. Give that field a slot "
    "(`memox.Memo()`), or declare it `{{slot}}: memox.Memo[...] | None` to say that None "
    "means no caching there (then nothing warns)."
)

OTHER_THREAD = (
    "`{method}` ran on a thread other than the one running the `memox.call` that holds "
    "its slot `{slot}` (a worker thread or a host callback started inside `fn`). A call's "
    "slots are live on its own thread only, so it computes every time and caches "
    "nothing. Call the method on the calling thread, inside `fn`, or run "
    "`memox.call(module, fn)` in the worker on the module it uses and pass the new "
    "module back."
)

LOOP_CLOSES_OVER = (
    "`memox.call` runs inside a `{loop}` body on a module that the loop closes over (its "
    "slots are not part of the loop's carry), so nothing it stores outlives the "
    "iteration: with an empty slot each cached method computes at every step, and a "
    "value filled before the loop is checked (its dependencies hashed) at every step. "
    "Pass `memox.hoist(module)` into the loop from a `memox.call` around it (the values "
    "are read once, before the loop: the way for a loop a library owns, such as a "
    "diffrax vector field or an optimistix solve), or, in your own loop, make the module "
    "part of the carry (`memox.init` it first) or use `memox.scan`."
)

TRACE_CLOSES_OVER = (
    "`memox.call` runs inside a function being traced (`jax.jit`, `eqx.filter_jit`, a "
    "library tracing a vector field, as diffrax does) that closes over a module whose "
    "slots are not allocated yet, so what it stores reaches the caller only if that "
    "function returns the new module; a vector field does not, and then each cached "
    "method computes at every evaluation. Pass `memox.hoist(module)` in place of the "
    "module from a `memox.call` around the solve (its values are read once, before), "
    "or take the module as an argument (`memox.init` it first) and return the new one."
)

HOISTED_WITH_ARGUMENTS = (
    "`{method}` was read ahead by `memox.hoist`, which holds one value per method, but "
    "is called with arguments here. Hoist only methods without arguments "
    "(`memox.hoist(module, Cls.method)`), and call this one through `memox.call`."
)

HOIST_OUTSIDE_CALL = (
    "`memox.hoist` reads cached values through the running `memox.call` or `memox.jit`, "
    "and none is running. Call it inside the function you pass to them: "
    "`memox.call(model, lambda m: solve(memox.hoist(m), ...))`."
)

UNHASHABLE_STATIC = (
    "memox keys a cached method on every non-array part of its module and arguments by "
    "equality, as `jax.jit` does for static arguments, but a `{type}` is neither "
    "hashable nor a plain value (number, string, tuple, NumPy array, ...), so it cannot "
    "be compared safely. Make it hashable (e.g. a frozen dataclass or a tuple), or pass "
    "it as a JAX array."
)


NO_BITS = (
    "memox stores and fingerprints an array by its bits, and cannot see those of dtype "
    "`{dtype}` exactly: JAX has no unsigned integer of its width ({bits} bits), and "
    "converting it to a 32-bit type loses or merges values. Cast the array to a dtype "
    "JAX can bit-cast (e.g. `x.astype(jnp.float32)`) before it reaches a cached method."
)


UNCACHED_STAGED = (
    "`{method}` computes without its slot in the program `memox.call` runs (inside a "
    "transformation opened inside `fn` that rebuilt the module, such as `eqx.filter_jit` "
    "or a diffrax solve, or on a module the call does not hold), so it computes at every "
    "evaluation and caches nothing. Pass `memox.hoist(module)` into that transformation "
    "instead of the module (its cached values are read once, before it), or call "
    "`memox.call` inside it on the module it receives and return the new module."
)

STORE_DROPPED = (
    "`{method}` stored its value in slot `{slot}` through a `memox.call` nested in "
    "another one (inside `fn`, a loop body, a `while_loop` condition, a branch or a "
    "vector field), but the module that nested call returned does not reach what the "
    "enclosing call returns: the value is dropped, and the method computes again at "
    "every evaluation. Return the new module (as a loop's carry, a branch's output, or "
    "`fn`'s result), or pass `memox.hoist(module)` into the transformation from the "
    "enclosing call (its values are read once, before it)."
)

BATCHED_PREDICATE = (
    "`{method}` runs under `jax.vmap` with batched dependencies or arguments, where a "
    "hit cannot skip the computation (`lax.cond` on a batched predicate runs both "
    "branches): memox computes it for every element at every call and counts each as a "
    "miss. Keep what it reads unbatched to reuse one value for the batch (`in_axes=None` "
    "for the module), or compute it once before the `vmap`."
)

NO_CALL = (
    "`{method}` ran inside {api} but outside `memox.call`, so it computes at every "
    "evaluation and caches nothing. Call it through `memox.call(module, fn)` inside the "
    "traced function and pass the new module on, or compile with `memox.jit(fn)` or "
    "`memox.filter_jit(fn)` where `fn` makes that call. If computing every time is what "
    "you want, silence this warning (given once per method) with "
    '`warnings.filterwarnings("ignore", category=memox.UncachedWarning)`.'
)

DELETED_SLOTS = (
    "memox: the arrays of slots {slots} were deleted: donated by a call you asked to "
    "donate them (`donate=` of `eqx.filter_jit` or `memox.filter_jit`, `donate_argnums` "
    "of `jax.jit`), so this call recomputes them. Use the module that call returned, or "
    "donate only what you no longer use (`memox.jit` never deletes what you hold: it "
    "donates a slot only where nothing else holds its arrays)."
)


class UncachedWarning(UserWarning):
    """A cached method computed without caching: inside `memox.call` where memox cannot
    reach its slot, or under a JAX transformation (`jax.jit`, `jax.vmap`, `jax.grad`,
    ...) outside any `memox.call`. The message says what to change. An eager call
    outside `memox.call` computes without a warning.

    !!! Example

        ```python
        import warnings

        with warnings.catch_warnings():  # or for the whole program: no `with`
            warnings.filterwarnings("ignore", category=memox.UncachedWarning)
            b = jax.jit(Foo.b)(foo)  # under `jax.jit`, outside `memox.call`: computes
        ```
    """


NOT_CANONICAL = (
    "memox runs in {processes} processes (`jax.process_count()`), and every process must "
    "compute the same cache key, but {what} has no canonical encoding: {why}. A key "
    "holding it would differ between processes (one would hit where another misses and "
    "waits in a collective). "
    "Make it a dataclass, NamedTuple or enum (encoded field by field, with its type), "
    "or a function whose closure and globals hold only such parts; pass an array as an "
    "array field of the module instead."
)

EMPTY_TRACED = (
    "An empty `memox.Memo` slot reached memox through a trace (an argument of `jax.jit`, "
    "a `lax.scan` carry, ...), where memox cannot allocate it without changing its type. "
    "Allocate it first with `module = memox.init(module)`, or `memox.init(module, fn, "
    "*args)` for a method that takes arguments (`memox.jit`, `memox.filter_jit` and "
    "`eqx.filter_jit` allocate by themselves)."
)

MESH_NOT_FOUND = (
    "A cached method's value is sharded over `Explicit` mesh axes {axes}, and none of its "
    "inputs lives on that mesh: outside a trace memox cannot place the slot's table there "
    "(it knows the mesh only abstractly). Call it where the mesh is set "
    "(`with jax.set_mesh(mesh):`, which also places new arrays on it), place one of the "
    "module's arrays on the mesh, or call it inside `memox.jit` / `jax.jit`."
)

FILTER_JIT_COMPILED_CALL = (
    "`memox.filter_jit`: the compiled `{name}` (from `.lower(...).compile()`) was called "
    "with arguments whose non-array parts or tree structure differ from those it was "
    "lowered for: its program is fixed. Call it as it was lowered (the same structure, "
    "the same non-array values), or lower and compile it again for these arguments."
)
