#include "llama-batch.h"

#include "llama-impl.h"
#include "llama-vocab.h"
#include "llama-memory.h"
#include "llama-hparams.h"
#include "llama-model.h"
#include "llama-context.h"

#include <cassert>
#include <cstring>
#include <algorithm>
#include <sstream>

llama_batch_allocr::llama_batch_allocr(uint32_t n_pos_per_embd, bool allow_mixed) : n_pos_per_embd(n_pos_per_embd), allow_mixed(allow_mixed) {
    const char * LLAMA_BATCH_DEBUG = getenv("LLAMA_BATCH_DEBUG");
    debug = LLAMA_BATCH_DEBUG ? atoi(LLAMA_BATCH_DEBUG) : 0;

    seq_pos.resize(LLAMA_MAX_SEQ);
    seq_cpl.resize(LLAMA_MAX_SEQ);
    for (auto & cur : seq_cpl) {
        cur.resize(LLAMA_MAX_SEQ);
    }

    seq_idx.resize(LLAMA_MAX_SEQ, -1);
}

bool llama_batch_allocr::init(
        const llama_batch_ext & batch_inp,
        const llama_vocab & vocab,
        bool output_all) {
    clear();

    this->vocab     = &vocab;
    this->n_embd    = batch_inp.n_embd > 0 ? batch_inp.n_embd : batch_inp.n_embd_inp;
    this->n_seq_max = batch_inp.n_seq_max;

    const int32_t n_tok = (int32_t) batch_inp.tokens.size();

    GGML_ASSERT(n_tok > 0);

    if ((uint32_t) n_seq_max > LLAMA_MAX_SEQ) {
        LLAMA_LOG_ERROR("%s: n_seq_max = %d > %d\n", __func__, n_seq_max, LLAMA_MAX_SEQ);
        return false;
    }

    const llama_memory_i * mem = batch_inp.mem;

    //
    // determine the content types of the batch
    // an entry can carry a token id, a token embedding, or both (e.g. MTP hook batches)
    // all entries must carry the same combination, or be a mix of token and embd entries
    //

    int32_t n_tok_only  = 0;
    int32_t n_embd_only = 0;
    int32_t n_both      = 0;

    for (int32_t i = 0; i < n_tok; ++i) {
        const bool is_tok = batch_inp.tokens[i].id != LLAMA_TOKEN_NULL;
        const bool is_emb = batch_inp.tokens[i].has_embd;

        if (!is_tok && !is_emb) {
            LLAMA_LOG_ERROR("%s: entry %d has neither a token id nor an embedding\n", __func__, i);
            return false;
        }

        n_tok_only  += is_tok && !is_emb;
        n_embd_only += is_emb && !is_tok;
        n_both      += is_tok &&  is_emb;
    }

    if (n_both > 0 && n_both != n_tok) {
        LLAMA_LOG_ERROR("%s: entries with both a token id and an embedding cannot be mixed with other entries\n", __func__);
        return false;
    }

    const bool mixed = n_tok_only > 0 && n_embd_only > 0;

    if (mixed && !allow_mixed) {
        LLAMA_LOG_ERROR("%s: this model or context does not support batches mixing token and embedding entries\n", __func__);
        return false;
    }

    const bool has_token = n_tok_only  > 0 || n_both > 0;
    const bool has_embd  = n_embd_only > 0 || n_both > 0;

    if (mixed) {
        is_embd_vec.resize(n_tok);
        for (int32_t i = 0; i < n_tok; ++i) {
            is_embd_vec[i] = batch_inp.tokens[i].has_embd ? 1 : 0;
        }
    }

    //
    // build flat token/embd array
    //

    if (has_token) {
        token_vec.resize(n_tok);
        for (