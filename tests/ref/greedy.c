// Greedy decoding through llama.cpp's plain C API, as the reference for Strata's own path.
// usage: greedy MODEL PROMPT N_PREDICT  -> prints the generated token ids, one line.
#include "llama.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void quiet(enum ggml_log_level level, const char * text, void * ud) {
    (void) level; (void) text; (void) ud;
}

int main(int argc, char ** argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s MODEL PROMPT N_PREDICT\n", argv[0]);
        return 2;
    }
    const int n_predict = atoi(argv[3]);
    llama_log_set(quiet, NULL);
    ggml_backend_load_all();

    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 1; }
    const struct llama_vocab * vocab = llama_model_get_vocab(model);

    const char * prompt = argv[2];
    const int n_max = (int) strlen(prompt) + 8;
    llama_token * toks = malloc(sizeof(llama_token) * n_max);
    const int n_prompt = llama_tokenize(vocab, prompt, (int) strlen(prompt), toks, n_max, true, true);
    if (n_prompt < 0) { fprintf(stderr, "tokenize failed\n"); return 1; }

    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512;
    cp.n_batch = 512;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "context failed\n"); return 1; }

    struct llama_sampler * smpl = llama_sampler_init_greedy();
    struct llama_batch batch = llama_batch_get_one(toks, n_prompt);
    llama_token next;
    for (int i = 0; i < n_predict; i++) {
        if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "decode failed\n"); return 1; }
        next = llama_sampler_sample(smpl, ctx, -1);
        if (llama_vocab_is_eog(vocab, next)) break;
        printf(i ? " %d" : "%d", next);
        batch = llama_batch_get_one(&next, 1);
    }
    printf("\n");
    llama_sampler_free(smpl);
    llama_free(ctx);
    llama_model_free(model);
    free(toks);
    return 0;
}
