/* The C API from C (C99): every function a C or Python caller needs, on the reference backend.
 * halfstep_c_api_exercise returns 0, or the number of the first check that failed (the C++ test
 * prints it with halfstep_last_error()). */
#include <halfstep/halfstep.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

#define N 40
#define CHECK(id, cond) \
  do {                  \
    if (!(cond)) return (id); \
  } while (0)

static uint16_t f16_bits(float x) { /* small normal values only: enough for gradients here */
  uint32_t b;
  memcpy(&b, &x, 4);
  return (uint16_t)(((b >> 16) & 0x8000u) | ((((b >> 23) & 0xFFu) - 112u) << 10) | ((b >> 13) & 0x3FFu));
}

int halfstep_c_api_exercise(const char* dir) {
  static float master[2][N], m[2][N], v[2][N];
  static uint16_t grad[2][N], model[2][N];
  halfstep_tensor tensors[2];
  halfstep_group groups[2];
  halfstep_config config;
  halfstep_optimizer* opt = NULL;
  halfstep_report report;
  halfstep_state state;
  int64_t counts[2], n_tensors = 0, applied = 0, attempts = 0;
  int32_t n_groups = 0;
  float lr[2], scale = 0.0f;
  size_t size = 0, bytes = 0;
  unsigned char saved[4096];
  char path[512], value[64];
  const char* names[2] = {"encoder.weight", "encoder.bias"};
  const char* keys[1] = {"epoch"};
  const char* values[1] = {"7"};
  int i, t;

  /* The version and the names of codes. */
  CHECK(1, strlen(halfstep_version()) >= 5);
  CHECK(2, halfstep_version_number() >= 200);
  CHECK(3, strcmp(halfstep_outcome_name(HALFSTEP_SKIPPED_NONFINITE_UPDATE), "skipped_nonfinite_update") == 0);
  CHECK(4, strcmp(halfstep_reason_name(HALFSTEP_REASON_INVALID_LEARNING_RATE), "invalid_learning_rate") == 0);
  CHECK(5, strcmp(halfstep_outcome_name(99), "unknown") == 0);
  {
    const int64_t numels[2] = {N, 3};
    CHECK(6, halfstep_workspace_bytes(numels, 2, 1, &bytes) == HALFSTEP_OK && bytes > 0);
    CHECK(7, halfstep_workspace_bytes(numels, -1, 1, &bytes) == HALFSTEP_ERROR_INVALID_ARGUMENT);
  }
  {
    /* The bytes of each state format: fp32 state 12 B held, 30 B moved; the lean one 6 and 20. */
    halfstep_config lean;
    halfstep_state_bytes b;
    halfstep_config_init(&lean);
    CHECK(83, halfstep_state_bytes_of(&lean, 1, &b) == HALFSTEP_OK && b.state == 12 && b.moved == 30);
    lean.grad_dtype = lean.model_dtype = HALFSTEP_BF16;
    lean.master_format = HALFSTEP_MASTER_BF16_REMAINDER;
    lean.exp_avg_format = lean.exp_avg_sq_format = HALFSTEP_MOMENT_BF16;
    CHECK(84, halfstep_state_bytes_of(&lean, 1, &b) == HALFSTEP_OK && b.state == 6 && b.moved == 20 &&
                  b.gradient == 2 && b.model == 2);
    lean.model_dtype = HALFSTEP_F16; /* remainders need a bf16 model copy */
    CHECK(85, halfstep_state_bytes_of(&lean, 1, &b) == HALFSTEP_ERROR_INVALID_ARGUMENT &&
                  strstr(halfstep_last_error(), "bf16_remainder") != NULL);
    CHECK(86, halfstep_state_bytes_of(NULL, 1, &b) == HALFSTEP_ERROR_INVALID_ARGUMENT);
    lean.model_dtype = HALFSTEP_BF16; /* no master: the bf16 model copy is the weight */
    lean.master_format = HALFSTEP_MASTER_NONE;
    CHECK(102, halfstep_state_bytes_of(&lean, 1, &b) == HALFSTEP_OK && b.state == 4 && b.moved == 16 &&
                   b.gradient == 2 && b.model == 2);
    CHECK(103, halfstep_state_bytes_of(&lean, 0, &b) == HALFSTEP_ERROR_INVALID_ARGUMENT &&
                   strstr(halfstep_last_error(), "none") != NULL);
  }
  {
    /* block8 moments: a code a moment (the scales are apart), and the blocks of a tensor's piece. */
    halfstep_config q;
    halfstep_state_bytes b;
    halfstep_tensor t;
    halfstep_moment_blocks mb;
    halfstep_config_init(&q);
    q.exp_avg_format = q.exp_avg_sq_format = HALFSTEP_MOMENT_BLOCK8;
    CHECK(104, halfstep_state_bytes_of(&q, 1, &b) == HALFSTEP_OK && b.state == 6 && b.moved == 18);
    halfstep_tensor_init(&t);
    CHECK(110, t.master == NULL && t.exp_avg_scale == NULL && t.numel == 0 && t.whole_numel == 0 && t.row == 0);
    t.numel = 5000; /* one row of 5000: 20 blocks */
    CHECK(105, halfstep_moment_blocks_of(&q, &t, &mb) == HALFSTEP_OK && mb.quantized == 1 && mb.blocks == 20 &&
                   mb.first == 0);
    t.whole_numel = 42000, t.row = 300, t.offset = 15000, t.numel = 256; /* rows of 2 blocks */
    CHECK(106, halfstep_moment_blocks_of(&q, &t, &mb) == HALFSTEP_OK && mb.quantized == 1 && mb.blocks == 1 &&
                   mb.first == 100);
    t.whole_numel = 0, t.row = 0, t.offset = 0, t.numel = 4095; /* too small: fp32 moments */
    CHECK(107, halfstep_moment_blocks_of(&q, &t, &mb) == HALFSTEP_OK && mb.quantized == 0 && mb.blocks == 0);
    CHECK(108, halfstep_moment_blocks_of(&q, NULL, &mb) == HALFSTEP_ERROR_INVALID_ARGUMENT);
    /* Shapes halfstep_create refuses are refused here too, by name. */
    t.whole_numel = 9000, t.row = 300, t.offset = 100, t.numel = 256; /* a cut inside a block */
    CHECK(111, halfstep_moment_blocks_of(&q, &t, &mb) == HALFSTEP_ERROR_INVALID_ARGUMENT &&
                   strstr(halfstep_last_error(), "must start and end where blocks do") != NULL);
    t.offset = 9000, t.numel = 300; /* past the tensor's end */
    CHECK(112, halfstep_moment_blocks_of(&q, &t, &mb) == HALFSTEP_ERROR_INVALID_ARGUMENT &&
                   strstr(halfstep_last_error(), "must be <= whole_numel") != NULL);
    t.whole_numel = 0, t.row = 0, t.offset = 256, t.numel = 256; /* a piece without its whole */
    CHECK(113, halfstep_moment_blocks_of(&q, &t, &mb) == HALFSTEP_ERROR_INVALID_ARGUMENT &&
                   strstr(halfstep_last_error(), "whole_numel must be set") != NULL);
    t.offset = 0, t.numel = -5;
    CHECK(114, halfstep_moment_blocks_of(&q, &t, &mb) == HALFSTEP_ERROR_INVALID_ARGUMENT &&
                   strstr(halfstep_last_error(), "numel must be >= 0") != NULL);
    t.whole_numel = 9000, t.row = 7000, t.numel = 9000; /* a row that does not divide it */
    CHECK(115, halfstep_moment_blocks_of(&q, &t, &mb) == HALFSTEP_ERROR_INVALID_ARGUMENT &&
                   strstr(halfstep_last_error(), "must divide") != NULL);
    { /* Moments to and from block8 codes: a 4096-element tensor in rows of 256 (16 blocks). */
      static float values[4096], back[4096], scales[16], kept[16];
      static uint8_t codes[4096];
      int k, close = 1;
      for (k = 0; k < 4096; ++k) values[k] = (float)((k * 37) % 101) * 1e-4f;
      t.whole_numel = 0, t.row = 256, t.offset = 0, t.numel = 4096;
      CHECK(116, halfstep_encode_moment(&t, HALFSTEP_EXP_AVG_SQ, values, codes, scales) == HALFSTEP_OK &&
                     scales[0] == sqrtf(100e-4f));
      CHECK(117, halfstep_decode_moment(&t, HALFSTEP_EXP_AVG_SQ, codes, scales, back) == HALFSTEP_OK);
      /* To nearest, a root is off by at most half the map's widest cell (the top decade's, 0.9/128 of
       * the block's largest root, at most sqrt(100e-4)), plus fp32 rounding. */
      for (k = 0; k < 4096; ++k) close &= fabsf(sqrtf(back[k]) - sqrtf(values[k])) <= (0.45f / 128.0f + 1e-6f) * 0.1f;
      CHECK(118, close);
      memcpy(kept, scales, sizeof scales);
      values[5] = -1.0f; /* a negative exp_avg_sq: refused, nothing written */
      CHECK(119, halfstep_encode_moment(&t, HALFSTEP_EXP_AVG_SQ, values, codes, scales) ==
                     HALFSTEP_ERROR_INVALID_ARGUMENT && strstr(halfstep_last_error(), "negative") != NULL &&
                     memcmp(kept, scales, sizeof scales) == 0);
      CHECK(120, halfstep_encode_moment(&t, 2, values, codes, scales) == HALFSTEP_ERROR_INVALID_ARGUMENT &&
                     strstr(halfstep_last_error(), "HALFSTEP_EXP_AVG") != NULL);
    }
    t.whole_numel = 0, t.row = 0, t.numel = 4095;
    q.exp_avg_sq_format = 3;
    CHECK(109, halfstep_moment_blocks_of(&q, &t, &mb) == HALFSTEP_ERROR_INVALID_ARGUMENT &&
                   strstr(halfstep_last_error(), "HALFSTEP_MOMENT_BLOCK8") != NULL);
  }

  /* Two tensors in two groups. */
  for (t = 0; t < 2; ++t) {
    for (i = 0; i < N; ++i) {
      master[t][i] = 0.5f - 0.01f * (float)i;
      m[t][i] = v[t][i] = 0.0f;
      grad[t][i] = f16_bits((0.001f + 0.0001f * (float)i) * 1024.0f);
    }
    halfstep_tensor_init(&tensors[t]);
    tensors[t].master = master[t];
    tensors[t].grad = grad[t];
    tensors[t].exp_avg = m[t];
    tensors[t].exp_avg_sq = v[t];
    tensors[t].model = model[t];
    tensors[t].numel = N;
    tensors[t].group = t;
    tensors[t].duplicate = 0;
    halfstep_group_init(&groups[t]);
  }
  groups[0].weight_decay = 0.01f;
  halfstep_config_init(&config);
  config.backend = HALFSTEP_BACKEND_REFERENCE;
  config.init_scale = 1024.0f;
  config.max_grad_norm = 1.0f;
  CHECK(10, halfstep_create(tensors, 2, groups, 2, &config, &opt) == HALFSTEP_OK);
  CHECK(11, halfstep_sizes(opt, &n_tensors, &n_groups) == HALFSTEP_OK && n_tensors == 2 && n_groups == 2);
  CHECK(12, halfstep_last_report(opt, &report) == HALFSTEP_ERROR_USAGE); /* no step yet */

  /* A step, its report, counts, scale and state. */
  CHECK(20, halfstep_step(opt, NULL) == HALFSTEP_OK);
  CHECK(21, halfstep_last_report(opt, &report) == HALFSTEP_OK);
  CHECK(22, report.outcome == HALFSTEP_APPLIED && report.reason == HALFSTEP_REASON_NONE && report.step == 1);
  CHECK(23, report.held_elements == 0 && report.numel == 2 * N && report.grad_norm > 0.0);
  CHECK(24, master[0][0] < 0.5f); /* the weight moved against its gradient */
  CHECK(25, halfstep_nonfinite_counts(opt, counts, 2) == HALFSTEP_OK && counts[0] == 0 && counts[1] == 0);
  CHECK(26, halfstep_loss_scale(opt, &scale) == HALFSTEP_OK && scale == 1024.0f);
  CHECK(27, *halfstep_device_loss_scale(opt) == 1024.0f);
  CHECK(28, halfstep_step_count(opt, &applied, &attempts) == HALFSTEP_OK && applied == 1 && attempts == 1);
  CHECK(29, halfstep_get_state(opt, &state) == HALFSTEP_OK && state.scale == 1024.0f && state.step == 1);
  CHECK(19, halfstep_device_step_count(opt) != NULL && *halfstep_device_step_count(opt) == 1);

  /* An overflow names its tensor. */
  grad[1][5] = 0x7C00;
  CHECK(30, halfstep_step(opt, NULL) == HALFSTEP_OK);
  CHECK(31, halfstep_last_report(opt, &report) == HALFSTEP_OK);
  CHECK(32, report.outcome == HALFSTEP_SKIPPED_OVERFLOW && report.reason == HALFSTEP_REASON_NONFINITE_GRADIENT);
  CHECK(33, report.first_nonfinite_tensor == 1);
  CHECK(34, halfstep_nonfinite_counts(opt, counts, 2) == HALFSTEP_OK && counts[1] == 1);
  grad[1][5] = grad[1][4];

  /* Learning rates: set_lr, device_lr, and an invalid one written on the device. */
  CHECK(40, halfstep_set_lr(opt, 1, 2e-4f, NULL) == HALFSTEP_OK);
  CHECK(41, halfstep_device_lr(opt, 0) != NULL);
  *halfstep_device_lr(opt, 0) = 3e-4f;
  CHECK(42, halfstep_learning_rates(opt, lr, 2) == HALFSTEP_OK && lr[0] == 3e-4f && lr[1] == 2e-4f);
  CHECK(43, halfstep_device_lr(opt, 5) == NULL && strstr(halfstep_last_error(), "group") != NULL);
  *halfstep_device_lr(opt, 0) = -1.0f;
  CHECK(44, halfstep_step(opt, NULL) == HALFSTEP_OK);
  CHECK(45, halfstep_last_report(opt, &report) == HALFSTEP_OK);
  CHECK(46, report.outcome == HALFSTEP_SKIPPED_NONFINITE_UPDATE &&
                report.reason == HALFSTEP_REASON_INVALID_LEARNING_RATE);
  *halfstep_device_lr(opt, 0) = 3e-4f;

  /* The optimizer-state checkpoint through a caller's buffer. */
  CHECK(50, halfstep_save_state(opt, NULL, 0, &size) == HALFSTEP_OK && size > 0 && size <= sizeof saved);
  CHECK(51, halfstep_save_state(opt, saved, sizeof saved, &size) == HALFSTEP_OK);
  CHECK(52, halfstep_step(opt, NULL) == HALFSTEP_OK);
  CHECK(53, halfstep_load_state(opt, saved, size) == HALFSTEP_OK);
  CHECK(54, halfstep_step_count(opt, &applied, &attempts) == HALFSTEP_OK && attempts == 3);

  /* A full checkpoint in a file, its metadata, and a restore. */
  snprintf(path, sizeof path, "%s/c_api.safetensors", dir);
  CHECK(60, halfstep_save_checkpoint(opt, names, 2, path, 1, keys, values, 1) == HALFSTEP_OK);
  CHECK(61, halfstep_checkpoint_metadata(path, "epoch", NULL, 0, &size) == HALFSTEP_OK && size == 1);
  CHECK(62, halfstep_checkpoint_metadata(path, "epoch", value, sizeof value, &size) == HALFSTEP_OK &&
                strcmp(value, "7") == 0);
  CHECK(63, halfstep_checkpoint_metadata(path, "missing", value, sizeof value, &size) ==
                HALFSTEP_ERROR_INVALID_ARGUMENT);
  {
    const float kept = master[0][3];
    master[0][3] = 99.0f;
    CHECK(64, halfstep_load_checkpoint(opt, names, 2, path) == HALFSTEP_OK);
    CHECK(65, master[0][3] == kept);
    CHECK(66, halfstep_load_checkpoint(opt, names, 1, path) == HALFSTEP_ERROR_INVALID_ARGUMENT);
  }
  remove(path);

  /* A group's hyperparameters, gradients that move (or are missing), a loss scale, gradients
   * already unscaled. */
  {
    float before[N];
    const void* moved[2];
    const void* back[2];
    halfstep_group h = groups[1];
    h.beta1 = 0.8f;
    h.lr = 2e-4f;
    CHECK(90, halfstep_set_group(opt, 1, &h, NULL) == HALFSTEP_OK);
    h.bias_correction = 0;
    CHECK(91, halfstep_set_group(opt, 1, &h, NULL) == HALFSTEP_ERROR_INVALID_ARGUMENT &&
                  strstr(halfstep_last_error(), "fixed") != NULL);
    moved[0] = grad[0];
    moved[1] = NULL; /* tensor 1 has no gradient this step: left alone */
    CHECK(92, halfstep_set_gradients(opt, moved, 2, NULL, 0) == HALFSTEP_OK);
    memcpy(before, master[1], sizeof before);
    CHECK(93, halfstep_step(opt, NULL) == HALFSTEP_OK && halfstep_last_report(opt, &report) == HALFSTEP_OK);
    CHECK(94, report.outcome == HALFSTEP_APPLIED && report.numel == N && memcmp(before, master[1], sizeof before) == 0);
    back[0] = grad[0];
    back[1] = grad[1];
    CHECK(95, halfstep_set_gradients(opt, back, 2, NULL, 0) == HALFSTEP_OK);
    CHECK(96, halfstep_set_gradients(opt, back, 1, NULL, 0) == HALFSTEP_ERROR_INVALID_ARGUMENT);
    CHECK(97, halfstep_set_loss_scale(opt, 512.0f, NULL) == HALFSTEP_OK &&
                  halfstep_loss_scale(opt, &scale) == HALFSTEP_OK && scale == 512.0f);
    CHECK(98, halfstep_set_loss_scale(opt, 0.0f, NULL) == HALFSTEP_ERROR_INVALID_ARGUMENT);
    CHECK(99, halfstep_mark_unscaled(opt, NULL) == HALFSTEP_OK);
    for (t = 0; t < 2; ++t) {
      for (i = 0; i < N; ++i) grad[t][i] = f16_bits(0.002f); /* already divided by the scale */
    }
    CHECK(100, halfstep_step(opt, NULL) == HALFSTEP_OK && halfstep_last_report(opt, &report) == HALFSTEP_OK);
    CHECK(101, report.outcome == HALFSTEP_APPLIED && fabs(report.grad_norm - 0.002 * sqrt(2.0 * N)) < 1e-5 &&
                   report.scale_used == 512.0f);
  }
  halfstep_destroy(opt);
  halfstep_destroy(NULL);

  /* Two ranks in one process, each holding one tensor, the caller reducing their records: SUM
   * over the first words, MAX over the last. An inf on rank 1 skips both, naming rank 1. */
  {
    halfstep_optimizer* rank[2] = {NULL, NULL};
    halfstep_report reports[2];
    uint64_t total[HALFSTEP_TOTALS_SUM_WORDS + HALFSTEP_TOTALS_MAX_WORDS];
    int r, w, s;
    for (r = 0; r < 2; ++r) {
      CHECK(70, halfstep_create_distributed(&tensors[r], 1, groups, 2, &config, r, NULL, 0, &rank[r]) == HALFSTEP_OK);
    }
    for (s = 0; s < 2; ++s) {
      grad[1][2] = s == 0 ? 0x7C00 : grad[1][3];
      memset(total, 0, sizeof total);
      for (r = 0; r < 2; ++r) {
        const uint64_t* mine;
        CHECK(71, halfstep_step_local(rank[r], NULL) == HALFSTEP_OK);
        mine = halfstep_device_totals(rank[r]);
        CHECK(72, mine != NULL);
        for (w = 0; w < HALFSTEP_TOTALS_SUM_WORDS; ++w) total[w] += mine[w];
        for (; w < HALFSTEP_TOTALS_SUM_WORDS + HALFSTEP_TOTALS_MAX_WORDS; ++w) {
          if (mine[w] > total[w]) total[w] = mine[w];
        }
      }
      for (r = 0; r < 2; ++r) {
        memcpy(halfstep_device_totals(rank[r]), total, sizeof total);
        CHECK(73, halfstep_step_finish(rank[r], NULL) == HALFSTEP_OK);
        CHECK(74, halfstep_last_report(rank[r], &reports[r]) == HALFSTEP_OK);
      }
      CHECK(75, reports[0].outcome == reports[1].outcome &&
                    (reports[0].grad_norm == reports[1].grad_norm ||
                     (reports[0].grad_norm != reports[0].grad_norm && reports[1].grad_norm != reports[1].grad_norm)));
      CHECK(76, reports[0].numel == 2 * N && reports[1].numel == 2 * N);
      if (s == 0) {
        CHECK(77, reports[1].outcome == HALFSTEP_SKIPPED_OVERFLOW && reports[1].first_nonfinite_rank == 1 &&
                      reports[1].first_nonfinite_tensor == 0);
      } else {
        CHECK(78, reports[0].outcome == HALFSTEP_APPLIED && reports[0].first_nonfinite_rank == -1);
      }
    }
    CHECK(79, halfstep_step_finish(rank[0], NULL) == HALFSTEP_ERROR_USAGE); /* no step_local */
    halfstep_destroy(rank[0]);
    halfstep_destroy(rank[1]);
  }
  /* A tensor left out of the norm still updates but does not count. */
  tensors[1].duplicate = 1;
  CHECK(80, halfstep_create(tensors, 2, groups, 2, &config, &opt) == HALFSTEP_OK);
  CHECK(81, halfstep_step(opt, NULL) == HALFSTEP_OK && halfstep_last_report(opt, &report) == HALFSTEP_OK);
  CHECK(82, report.numel == N && report.outcome == HALFSTEP_APPLIED);
  halfstep_destroy(opt);
  return 0;
}
